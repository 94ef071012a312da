"""A gpt-oss checkpoint with MXFP4 experts at TENSOR_PARALLEL_SIZE=2 on the CPU (gloo, two processes): each rank
reads its rows of gate|up's blocks and whole blocks of down_proj's inputs, and answers as one rank and as
transformers do; a size that would cut a block of 32 is refused in one line."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from engine.errors import StartupError
from engine.model.layers.parallel import TensorParallel
from engine.model.loader import load_model
from tests.engine.core.distributed.tp_models import check_split_answers, child_pids, copy_tokenizer
from tests.engine.model.family_parity import reference_logits, tiny_engine
from tests.engine.model.gpt_oss_checkpoints import build_gpt_oss


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
    check_split_answers(partial(reference_logits, hf), one, two, prompt, 8)


def test_a_size_that_cuts_a_block_is_refused(tmp_path, baked_model_path):
    mxfp4_checkpoint(tmp_path, baked_model_path)  # 96 intermediate columns: 48 to a rank at size 2
    with pytest.raises(StartupError, match="tensor_parallel_size=2 would cut the experts' MXFP4 blocks of 32"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"), tp=TensorParallel(0, 2))
