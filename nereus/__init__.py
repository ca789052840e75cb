"""nereus: adaptive parallelism and stage fusion for RL post-training of LLMs."""

__version__ = "0.1.0"
