"""LoRA adapters at TENSOR_PARALLEL_SIZE=2 on the CPU (gloo, two processes), each rank holding its part of every
adapter (B's rows of a column-parallel projection, A's columns of a row-parallel one): prompt log-probabilities
against one rank and against transformers on the merged weights, a batch mixing adapters and the base equal to one
rank's, adapters loaded while serving (into a slot an unloaded one left) reaching every rank, and an adapter
shaped for one rank's part refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.config import LoraConfig
from engine.errors import UnsupportedModel
from engine.model.adapters import projection_shapes
from tests.engine.core.distributed.tp_models import child_pids, save_tp_model
from tests.engine.core.engine_run import greedy, make_engine, random_prompts, run
from tests.lora_adapters import ALL_TARGETS, merge_into, write_adapter

ATOL = 2e-4  # log-probabilities, float32: the ranks sum the same products in another order
# Biased projections with two KV heads split; one KV head replicated on both ranks (with Qwen3's q / k norms).
KINDS = ("llama_biased", "qwen3_one_kv_head")
# Every projection; attention only with rsLoRA; the MLP of one layer only (loaded while serving).
ADAPTERS = {
    "all": dict(targets=ALL_TARGETS, rank=4, alpha=8.0, seed=1),
    "attn": dict(targets=["q_proj", "k_proj", "v_proj", "o_proj"], rank=8, alpha=4.0, seed=2, use_rslora=True),
    "mlp": dict(targets=["gate_proj", "up_proj", "down_proj"], rank=2, alpha=2.0, seed=3, layers=[1]),
}
AT_START = ("all", "attn")


def scale_of(spec: dict) -> float:
    return spec["alpha"] / (spec["rank"] ** 0.5 if spec.get("use_rslora") else spec["rank"])


@pytest.fixture(scope="module", params=KINDS)
def tp_lora(request, tmp_path_factory, baked_model_path):
    """(transformers models by adapter, adapter folders, TP=1 engine, TP=2 engine): the same checkpoint and adapters,
    two loaded at start-up, room for one more while serving."""
    import transformers as tf

    root = tmp_path_factory.mktemp(f"tp-lora-{request.param}")
    path = save_tp_model(request.param, root / "model", baked_model_path)
    config = tf.AutoConfig.from_pretrained(path)
    hf = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    references, folders = {None: hf}, {}
    for name, spec in ADAPTERS.items():
        folders[name] = str(root / name)
        tensors = write_adapter(root / name, projection_shapes(config), config.num_hidden_layers, std=0.3, **spec)
        references[name] = merged = copy.deepcopy(hf)
        merge_into(merged, tensors, scale_of(spec))
    lora = LoraConfig({n: folders[n] for n in AT_START}, max_loras=3, max_lora_rank=8, runtime=True)
    before = child_pids()
    one = make_engine(path, lora=lora)
    two = make_engine(path, lora=lora, tensor_parallel_size=2)
    assert len(child_pids() - before) == 1  # rank 1
    yield references, folders, one, two
    two.close()
    one.close()
    assert child_pids() <= before, "a rank outlived its engine"


def answers(engine, requests) -> dict[str, list[int]]:
    return {r: res.choices[0].token_ids for r, res in run(engine, requests).items()}


def test_prompt_logprobs_per_adapter_match_one_rank_and_transformers_merged(tp_lora):
    references, _, one, two = tp_lora
    prompts = random_prompts(6, 5, 30, seed=1)
    adapters = [None, *AT_START] * 2
    requests = {
        f"r{i}": (p, greedy(1, prompt_logprobs=0, adapter=a))
        for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))
    }
    single, split = run(one, requests), run(two, requests)  # each one batch of the base's rows and two adapters'
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        with torch.no_grad():
            logits = references[adapter](torch.tensor([prompt])).logits[0]
            base = references[None](torch.tensor([prompt])).logits[0]
        if adapter is not None:  # the adapter changes the output, so the checks below can fail
            assert (logits - base).abs().max() > 1e-2
        ref = torch.log_softmax(logits.float(), dim=-1)
        expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
        got = [p.chosen.logprob for p in split[f"r{i}"].first.prompt_logprobs[1:]]
        assert got == pytest.approx(expected, abs=ATOL), adapter
        assert got == pytest.approx([p.chosen.logprob for p in single[f"r{i}"].first.prompt_logprobs[1:]], abs=ATOL), (
            adapter
        )


def test_a_batch_mixing_adapters_and_the_base_answers_as_one_rank_and_transformers(tp_lora):
    references, _, one, two = tp_lora
    prompts = random_prompts(6, 3, 25, seed=2)
    adapters = [None, *AT_START] * 2
    requests = {
        f"r{i}": (p, greedy(10, ignore_eos=True, adapter=a))
        for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))
    }
    split = answers(two, requests)
    assert split == answers(one, requests)
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        with torch.no_grad():
            ref = (
                references[adapter]
                .generate(
                    torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
                )[0, len(prompt) :]
                .tolist()
            )
        assert split[f"r{i}"] == ref, adapter
    # Each adapter answers the same prompt its own way, so the equalities above are not vacuous.
    same = {a: answers(two, {"x": (prompts[0], greedy(10, ignore_eos=True, adapter=a))})["x"] for a in adapters[:3]}
    assert len({tuple(t) for t in same.values()}) == 3


def test_adapters_loaded_while_serving_reach_every_rank_and_a_reused_slot_is_emptied(tp_lora):
    _, folders, one, two = tp_lora
    prompt = random_prompts(1, 12, 12, seed=3)[0]

    def ask(engine, adapter):
        return answers(engine, {"x": (prompt, greedy(10, ignore_eos=True, adapter=adapter))})["x"]

    for engine in (one, two):
        engine.install_adapter("mlp", engine.lora.read("mlp", folders["mlp"]))
    assert ask(two, "mlp") == ask(one, "mlp") != ask(two, None)
    # The freed slot held MLP deltas: an attention-only adapter loaded into it must leave every rank's MLP alone.
    for engine in (one, two):
        engine.remove_adapter("mlp")
        engine.install_adapter("attn-again", engine.lora.read("attn-again", folders["attn"]))
    assert two.lora.slots["attn-again"] == 2
    assert ask(two, "attn-again") == ask(one, "attn-again") == ask(two, "attn")
    for engine in (one, two):
        engine.remove_adapter("attn-again")


def test_an_adapter_shaped_for_one_ranks_part_is_refused_in_one_line(tp_lora, tmp_path):
    """Adapters are checked against the whole model, then cut: one trained on a rank's half is another model's."""
    _, _, _, two = tp_lora
    half = {t: (out // 2, inp) for t, (out, inp) in two.lora.shapes.items()}
    write_adapter(tmp_path / "half", half, 2, targets=["q_proj"])
    with pytest.raises(UnsupportedModel, match="adapter 'half': .*another base model") as info:
        two.lora.read("half", str(tmp_path / "half"))
    assert "\n" not in info.value.message
