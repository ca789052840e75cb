"""A config.json holding both RoPE formats, disagreeing, computes in nereus the network
transformers computes from the same file (issue 47): a tiny random Llama saved by
transformers, its config then given a `rope_parameters` block and a top-level
`rope_theta`/`rope_scaling` that say other things. nereus's reference model, with the
folder's weights, matches `AutoModelForCausalLM`'s logits within 1e-5 (fp32); the Model read
the other way (the `rope_parameters` block) does not, so the comparison can fail."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.one_rank

from hf_helpers import read_logical, save_random_model  # noqa: E402

from nereus.runtime.model.transformer import ReferenceModel  # noqa: E402
from nereus.spec.hf_config import model_from_hf_config  # noqa: E402
from nereus.spec.model import LinearRopeScaling, Model  # noqa: E402

TOL = 1e-5
VOCAB, ROWS, SEQ = 96, 3, 24

#: rope_parameters says plain RoPE at theta 1e6; the top-level keys say linear by 4 at 1e4.
BOTH_FORMATS: dict[str, Any] = {
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "rope_theta": 1e4,
}


def logits_error(folder: Path, model: Model) -> float:
    """Largest |logit| difference between nereus's reference model and transformers' on random tokens."""
    tokens = torch.randint(1, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens, dtype=torch.bool)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = ReferenceModel(model)
    logical = read_logical(folder, model, "lm")
    with torch.no_grad():
        theirs = theirs_model(input_ids=tokens).logits
        for name, param in reference.named_logical_parameters().items():
            param.copy_(logical[name])
        ours = reference(tokens, mask)
    return float((ours - theirs).abs().max())


def test_both_rope_formats_compute_what_transformers_computes(tmp_path: Path) -> None:
    shapes = {"num_hidden_layers": 2, "vocab_size": VOCAB, "eos_token_id": None, "tie_word_embeddings": False}
    folder = save_random_model(tmp_path / "llama", "LlamaConfig", shapes)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text(encoding="utf-8")), **BOTH_FORMATS}), encoding="utf-8")
    model = model_from_hf_config(folder)
    assert (model.rope_theta, model.rope_scaling) == (1e4, LinearRopeScaling(type="linear", factor=4.0))
    assert logits_error(folder, model) < TOL
    the_other_format = model.model_copy(update={"rope_theta": 1e6, "rope_scaling": None})
    assert logits_error(folder, the_other_format) > 100 * TOL
