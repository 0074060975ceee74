"""The offline tiny model for vLLM: a byte-level BPE tokenizer, a ``LlamaForCausalLM`` config and seeded
weights, built into a directory that ``vllm --model DIR`` (and transformers) loads with no hub.

    python -m kvown.apps.serve.vllm.model OUT_DIR [--seed 0] [--vocab 2048]

Rules:
  1. Deterministic: the training text is generated from a fixed word list and seed, the tokenizer is
     trained single-threaded, the weights come from a seeded ``torch.Generator`` on the CPU and are
     saved with sorted metadata; two builds with the same options are byte-identical (tested).
  2. Weights are saved as bf16 safetensors; an fp32 instance upcasts them exactly, so an fp32 and a bf16
     instance start from the same values, and every instance of one build computes the same bits.
  3. Shapes fit vLLM's CPU attention: head_dim 64, 2 KV heads; max positions 2048.
  4. Runs where ``tokenizers``, ``safetensors`` and ``torch`` are importable: the vLLM venv (the stack
     calls it with that python); imports them inside ``build`` only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kvown.core.errors import ConfigError, require_positive_ints

WORDS = (  # noqa: SIM905 (one word list, easier to read as text)
    "the of and to in is was for on that with as by at from his her they this are an be or had not "
    "but which one you all were we there their been has have more when who will time would into only "
    "about some than then them these so can may other after first new two years over most also made "
    "state like over such where through many before must well back down even because any each those "
    "people just very great under world still between long since while city last own found part "
    "block cache token prefill decode write read fence writer reader session proof retire deadline "
    "memory region transfer request cancel abort quiesce publish owner lease model layer head key "
    "value queue stream server client proxy engine worker scheduler kernel thread core batch page "
    "river mountain garden window morning evening summer winter letter music paper table stone light "
    "green blue red yellow small large quick slow quiet bright old young early late open close"
).split()
SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class TinyConfig:
    """The Llama shape written to ``config.json`` under Hugging Face's names, and the weights' seed."""

    vocab_size: int = 2048
    hidden_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    max_position_embeddings: int = 2048
    seed: int = 0

    def check(self) -> None:
        require_positive_ints(self, asdict(self), zero_ok=("seed",))
        if self.vocab_size < 256 + len(SPECIALS):
            raise ConfigError("vocab_size must hold the 256 byte tokens and the specials", field="vocab_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads",
                              field="num_key_value_heads")


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """The training text (rule 1): sentences of ``WORDS`` with digits and punctuation, seeded."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 18))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice(".,;:!?"))
    return out


def build_tokenizer(cfg: TinyConfig, out: Path) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # rule 1: one thread, one merge order
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(cfg.seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[1],
        "pad_token": SPECIALS[2],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    })


def hf_config(cfg: TinyConfig) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def weight_shapes(cfg: TinyConfig) -> dict[str, tuple[int, ...]]:
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    q, ffn = cfg.num_attention_heads * cfg.head_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn),
        }
    return shapes | {"model.norm.weight": (h,), "lm_head.weight": (cfg.vocab_size, h)}


def build_weights(cfg: TinyConfig, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    tensors = {}
    for name, shape in sorted(weight_shapes(cfg).items()):  # sorted: the draw order is fixed (rule 1)
        if len(shape) == 1:  # norms: ones, so activations keep their scale
            t = torch.ones(shape)
        else:  # std 1/sqrt(fan_in) keeps greedy output varied rather than one repeated token
            t = torch.randn(shape, generator=gen) * (1.0 if "embed" in name else shape[1] ** -0.5)
        tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def build(out_dir: str | Path, cfg: TinyConfig | None = None) -> Path:
    """Build the model into ``out_dir`` (created; existing files replaced). Returns the directory."""
    cfg = cfg or TinyConfig()
    cfg.check()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(cfg, out)
    _write_json(out / "config.json", hf_config(cfg))
    _write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
                                                 "do_sample": False})
    build_weights(cfg, out)
    _write_json(out / "kvown_model.json", {"builder": "kvown.apps.serve.vllm.model", **asdict(cfg)})
    return out


def digest(model_dir: str | Path) -> str:
    """SHA-256 over every file of a model directory (name and bytes), in name order."""
    h = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvown.apps.serve.vllm.model",
                                description="build the offline tiny Llama model for vLLM")
    p.add_argument("out", help="directory to build into")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=2048)
    a = p.parse_args(argv)
    out = build(a.out, TinyConfig(vocab_size=a.vocab, seed=a.seed))
    print(f"{out} {digest(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
