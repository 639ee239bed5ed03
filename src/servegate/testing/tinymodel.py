"""A tiny Llama model, tokenizer and LoRA adapters built on the spot, for real engines.

The engine test tier runs real vLLM on CPU where no model hub is reachable, so the
model it serves is made here: a byte-level BPE tokenizer trained on a synthetic
corpus, a random-weight `LlamaForCausalLM`, and PEFT-format LoRA adapters written
tensor by tensor (no `peft` package). Its text is noise; its tokens, KV blocks,
metrics and adapter slots are real. Builds are deterministic and cached under a key
that hashes the spec and `BUILD_VERSION`, so a second run costs nothing.

torch, transformers and tokenizers come with vLLM (`.venv-engine`) and are imported
only inside the functions that need them, so the package imports without them.

    python -m servegate.testing.tinymodel [--cache-dir DIR]   # prints the model dir
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

BUILD_VERSION = 2
"""Bump when the build changes in a way the spec does not show, to invalidate caches."""

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
LORA_TARGETS = ("q_proj", "v_proj")
_DONE = "BUILD_OK"

_WORDS = (
    "the", "a", "an", "of", "to", "in", "on", "for", "with", "by", "from", "at", "as", "is",
    "are", "was", "be", "router", "cache", "block", "token", "prefix", "replica", "engine",
    "request", "queue", "model", "server", "gateway", "picker", "score", "load", "adapter",
    "stream", "chat", "system", "user", "assistant", "hello", "world", "alpha", "beta",
    "gamma", "delta", "north", "south", "east", "west", "red", "green", "blue", "one", "two",
    "three", "four", "five", "six", "seven", "eight", "nine", "ten", "zero", "question",
    "answer", "story", "river", "mountain", "city", "garden", "window", "paper", "music",
    "number", "letter", "summary",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Everything that decides the built bytes; its hash names the cache folder."""

    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 4096
    seed: int = 1234
    corpus_lines: int = 2000
    adapters: tuple[str, ...] = ("a1", "a2", "a3")
    lora_rank: int = 8
    lora_alpha: int = 16

    def key(self) -> str:
        doc = {"build_version": BUILD_VERSION, **asdict(self)}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class TinyModel:
    """A built model: `model_dir` holds config, weights and tokenizer; adapters by name."""

    spec: TinyModelSpec
    root: Path
    model_dir: Path
    adapters: Mapping[str, Path] = field(default_factory=lambda: MappingProxyType({}))


def repo_root() -> Path:
    """The checkout this module lives in (src/servegate/testing → three levels up)."""
    return Path(__file__).resolve().parents[3]


def default_cache_dir() -> Path:
    return repo_root() / ".cache" / "tinymodel"


def build_tiny_model(cache_dir: Path | None = None, spec: TinyModelSpec | None = None) -> TinyModel:
    """The model for `spec`, built into `cache_dir/<spec key>` unless already there."""
    spec = spec or TinyModelSpec()
    base = (cache_dir or default_cache_dir()).resolve()
    root = base / spec.key()
    if not (root / _DONE).is_file():
        base.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{spec.key()}-", dir=base))
        staging.chmod(0o755)
        try:
            _build(staging, spec)
            (staging / _DONE).write_text(json.dumps(asdict(spec), sort_keys=True) + "\n")
            if root.exists():
                shutil.rmtree(root)
            os.replace(staging, root)
        finally:
            if staging.exists():
                shutil.rmtree(staging)
    return _layout(root, spec)


def _layout(root: Path, spec: TinyModelSpec) -> TinyModel:
    adapters = {name: root / "adapters" / name for name in spec.adapters}
    return TinyModel(
        spec=spec, root=root, model_dir=root / "model", adapters=MappingProxyType(adapters)
    )


def _build(root: Path, spec: TinyModelSpec) -> None:
    layout = _layout(root, spec)
    layout.model_dir.mkdir(parents=True)
    tokenizer_size = _build_tokenizer(layout.model_dir, spec)
    _build_model(layout.model_dir, spec, tokenizer_size)
    for index, name in enumerate(sorted(layout.adapters)):
        _build_adapter(
            layout.adapters[name], spec, seed=spec.seed + 1 + index, base=layout.model_dir
        )


def synthetic_corpus(spec: TinyModelSpec) -> list[str]:
    """Reproducible lines of English-looking words, digits and chat-formatted turns."""
    rng = random.Random(spec.seed)
    lines = []
    for i in range(spec.corpus_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 24))]
        if i % 5 == 0:
            words.append(str(rng.randint(0, 99999)))
        line = " ".join(words)
        if i % 7 == 0:
            line = f"<|user|>\n{line}\n<|assistant|>\n{line.capitalize()}."
        lines.append(line)
    return lines


def _build_tokenizer(model_dir: Path, spec: TinyModelSpec) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    fast_tokenizer: Any = PreTrainedTokenizerFast  # untyped in transformers 5
    special = [BOS, EOS, PAD, *ROLE_TOKENS]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(spec), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    wrapped = fast_tokenizer(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(str(model_dir))
    return int(tok.get_vocab_size())


def _build_model(model_dir: Path, spec: TinyModelSpec, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    causal_lm: Any = LlamaForCausalLM  # untyped in transformers 5
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = causal_lm(config).to(torch.bfloat16).eval()
    model.save_pretrained(str(model_dir), safe_serialization=True)


def lora_tensor_shapes(spec: TinyModelSpec) -> dict[str, tuple[int, int]]:
    """PEFT tensor names and shapes: A is (r, in), B is (out, r) for q_proj and v_proj."""
    head_dim = spec.hidden_size // spec.num_heads
    out = {"q_proj": spec.num_heads * head_dim, "v_proj": spec.num_kv_heads * head_dim}
    shapes: dict[str, tuple[int, int]] = {}
    for layer in range(spec.num_layers):
        for module in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            shapes[f"{prefix}.lora_A.weight"] = (spec.lora_rank, spec.hidden_size)
            shapes[f"{prefix}.lora_B.weight"] = (out[module], spec.lora_rank)
    return shapes


def adapter_config(spec: TinyModelSpec, base: Path) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": spec.lora_rank,
        "lora_alpha": spec.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "inference_mode": True,
    }


def _build_adapter(path: Path, spec: TinyModelSpec, seed: int, base: Path) -> None:
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: (torch.randn(shape, generator=generator) * 0.05).to(torch.bfloat16)
        for name, shape in lora_tensor_shapes(spec).items()
    }
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    doc = adapter_config(spec, base)
    (path / "adapter_config.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    model = build_tiny_model(args.cache_dir)
    print(model.model_dir)
    for name, path in model.adapters.items():
        print(f"{name}={path}")


if __name__ == "__main__":
    main()
