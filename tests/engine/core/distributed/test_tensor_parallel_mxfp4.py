"""A gpt-oss checkpoint with MXFP4 experts at TENSOR_PARALLEL_SIZE=2 on the CPU (gloo, two processes): each rank
reads its rows of gate|up's blocks and whole blocks of down_proj's inputs, and answers as one rank and as
transformers do; a size that would cut a block of 32 is refused in one line."""

from __future__ import annotations

import pytest
import torch

from engine.errors import StartupError
from engine.model.layers.parallel import TensorParallel
from engine.model.loader import load_model
from engine.sample.params import SamplingParams
from tests.engine.core.distributed.tp_models import child_pids, copy_tokenizer
from tests.engine.core.engine_run import run
from tests.engine.model.family_parity import hf_greedy, mixed_prompts, reference_logits, tiny_engine
from tests.engine.model.gpt_oss_checkpoints import build_gpt_oss

ATOL = 2e-4


def mxfp4_checkpoint(path, baked_model_path, **overrides):
    hf = build_gpt_oss(path, "mxfp4", **overrides)
    copy_tokenizer(path, baked_model_path)
    return hf


@pytest.fixture(scope="module")
def tp_mxfp4(tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    hf = mxfp4_checkpoint(path, baked_model_path, intermediate_size=64)  # 32 columns of each expert a rank
    before = child_pids()
    one, two = tiny_engine(path), tiny_engine(path, tensor_parallel_size=2)
    yield hf, one, two
    two.close()
    one.close()
    assert child_pids() <= before, "a rank outlived its engine"


def test_prompt_logprobs_and_greedy_match_one_rank_and_transformers(tp_mxfp4):
    hf, one, two = tp_mxfp4
    prompt = torch.randint(3, 128, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    requests = {"p": (prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))}
    ref = torch.log_softmax(reference_logits(hf, prompt), dim=-1)
    expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
    got = [p.chosen.logprob for p in run(two, requests)["p"].first.prompt_logprobs[1:]]
    assert got == pytest.approx(expected, abs=ATOL)
    assert got == pytest.approx([p.chosen.logprob for p in run(one, requests)["p"].first.prompt_logprobs[1:]],
                                abs=ATOL)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = {r: (p, params) for r, p in mixed_prompts().items()}
    batched = run(two, requests)
    for r, (p, _) in requests.items():
        assert batched[r].choices[0].token_ids == hf_greedy(hf, p, 8), r


def test_a_size_that_cuts_a_block_is_refused(tmp_path, baked_model_path):
    mxfp4_checkpoint(tmp_path, baked_model_path)  # 96 intermediate columns: 48 to a rank at size 2
    with pytest.raises(StartupError, match="tensor_parallel_size=2 would cut the experts' MXFP4 blocks of 32"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"), tp=TensorParallel(0, 2))
