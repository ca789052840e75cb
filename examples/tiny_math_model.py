"""Make a tiny Hugging Face model folder to post-train on math word problems, offline.

    python examples/tiny_math_model.py OUT [CORPUS.jsonl ...]

The folder holds what a downloaded model folder holds: a random two-layer Qwen2 causal LM
(config.json, model.safetensors, written by transformers) and a real tokenizer (a byte-level
BPE trained with the `tokenizers` library on the corpus's text: tokenizer.json, plus
tokenizer_config.json with its special tokens and a chat template). Needs `transformers`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: Special tokens of the tokenizer, in id order.
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
#: A minimal chat template: each message as "role: content" on its own line, then the
#: assistant's turn opened.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
#: Tokens the trained tokenizer has at most (a byte-level BPE starts from 256 byte tokens).
VOCAB_SIZE = 320
DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "math-train.jsonl"


def corpus_text(files: list[Path]) -> list[str]:
    """Every string value of every JSON line of `files` (prompts, answers, chat contents)."""
    texts = ["system: user: assistant: #### \\boxed{} 0 1 2 3 4 5 6 7 8 9"]
    for path in files:
        for line in path.read_text(encoding="utf-8").splitlines():
            stack = [json.loads(line)] if line.strip() else []
            while stack:
                value = stack.pop()
                if isinstance(value, str):
                    texts.append(value)
                elif isinstance(value, dict):
                    stack += list(value.values())
                elif isinstance(value, list):
                    stack += value
    return texts


def save_tokenizer(folder: Path, corpus: list[Path]) -> int:
    """Train and save the tokenizer into `folder`; its number of tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_text(corpus), trainer)
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos)])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": 256,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return int(tokenizer.get_vocab_size())


def save_model(folder: Path, vocab_size: int) -> None:
    """A random two-layer Qwen2 causal LM of `vocab_size` tokens, fp32, seed 0."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)


def make_folder(folder: Path, corpus: list[Path]) -> Path:
    """The tokenizer and the model, in `folder`."""
    save_model(folder, save_tokenizer(folder, corpus))
    return folder


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    files = [Path(arg) for arg in sys.argv[2:]] or [DEFAULT_CORPUS]
    out = make_folder(Path(sys.argv[1]), files)
    print(f"wrote {out} ({', '.join(sorted(path.name for path in out.iterdir()))})")
