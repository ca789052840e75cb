"""Generation: the continuous-batching engine, its paged KV cache and block scheduler, sampling."""
