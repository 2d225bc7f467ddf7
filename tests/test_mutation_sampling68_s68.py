"""Session 68's mutation check of scheduler/sampling.py, logprobs.py, generation_defaults.py and sampler_fields.py
(second pass, after sessions 61, 62 and 67): the rules no test pinned, each test here failing on one mutant and
passing as the code is. Unit level, on the CPU: chat's `logprobs: false`, an empty chunk's columns, a
generation_config's falsy defaults (temperature 0: greedy) and a directory of its name, a negative seed's bits,
and the sampling kernel's host side (each draw's key moving on, CPU and CUDA generators; strided logits kept
off the kernel)."""
from __future__ import annotations

import torch

from scheduler import sampling
from scheduler.generation_defaults import GenerationDefaults, read_generation_defaults
from scheduler.logprobs import ChatLogprobsFields, LogprobsShaper
from scheduler.sampling import _step_seed, sample, seeded_generator
from test_generation_defaults import complete

CPU = torch.device("cpu")


# ---- logprobs.py --------------------------------------------------------------------------------------------
def test_chat_logprobs_false_asks_for_none_whatever_top_logprobs_0_says():
    """`logprobs: false` (with or without `top_logprobs: 0`) is no logprobs, as left out; true alone is the sampled
    token's (mutant L4: a false that was given counted as asking, and every token carried a logprob)."""
    assert ChatLogprobsFields(logprobs=False).logprob_count() is None
    assert ChatLogprobsFields(logprobs=False, top_logprobs=0).logprob_count() is None
    assert ChatLogprobsFields(logprobs=True, top_logprobs=0).logprob_count() == 0


def test_a_chunk_of_no_tokens_renders_empty_columns():
    """A completion's chunk or response with no token entries has four empty columns (mutant L19: its text_offset
    column held a stray entry, one more than its tokens)."""
    assert LogprobsShaper(None, chat=False).render([]) == {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                           "text_offset": []}
    assert LogprobsShaper(None, chat=True).render([]) == {"content": []}


# ---- generation_defaults.py ---------------------------------------------------------------------------------
def test_a_files_falsy_defaults_still_fill_the_requests_fields():
    """A generation_config.json of temperature 0 makes a request without temperature greedy; min_p 0 and top_k 0
    are defaults too (neutral), and the start-up line names them (mutant G14: given() dropped the falsy values,
    and such a request sampled at temperature 1)."""
    zero = GenerationDefaults(temperature=0.0, top_k=0, min_p=0.0)
    assert zero.given() == {"temperature": 0.0, "top_k": 0, "min_p": 0.0}
    params = complete({}, zero)
    assert params.temperature == 0.0
    assert "temperature 0.0" in zero.describe()
    assert complete({"temperature": 0.5}, zero).temperature == 0.5


def test_a_directory_named_generation_config_is_no_file(tmp_path):
    """Only a file is read: a directory of that name in the checkpoint gives no defaults, as no file does
    (mutant G17: exists() took it, and reading it stopped the server with an IsADirectoryError)."""
    (tmp_path / "generation_config.json").mkdir()
    assert read_generation_defaults(tmp_path) == GenerationDefaults()


# ---- sampling.py ---------------------------------------------------------------------------------------------
def _draws(seed: int) -> list[int]:
    logits = torch.zeros(1, 64)
    gen = seeded_generator(seed, CPU)
    return [int(sample(logits, [1.0], [1.0], [gen])[0]) for _ in range(12)]


def test_a_negative_seed_is_its_twos_complement_bits_not_its_magnitude():
    """-1 draws as 2**64 - 1 (api_inputs.choice_params wraps seed + j past SEED_MAX to a negative seed, and relies
    on this to keep the stream), and -7 draws otherwise than 7 (mutant S27: abs(seed), so -7 and 7 collided and
    the wrapped choice's seed was another stream's)."""
    assert _draws(-1) == _draws((1 << 64) - 1)
    assert _draws(-(1 << 63)) == _draws(1 << 63)
    assert _draws(-7) != _draws(7)


class _CudaLikeGenerator:
    """What `_step_seed` reads of a CUDA generator (its device, seed and Philox offset), on a machine without one."""
    device = torch.device("cuda")

    def __init__(self, seed: int) -> None:
        self.seed, self.offset = seed, 0

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


def test_a_cuda_generators_kernel_key_moves_on_with_each_draw_and_repeats_per_seed():
    """The sampling kernel's key of a seeded row on CUDA: the n-th draw's key is the same for every request of
    that seed, differs from the draw before (the Philox offset moves on by 4, as a draw of its own would), and
    differs between seeds (mutant S38: the offset stood still, so every token of a seeded request had the same
    key: the same uniforms, step after step)."""
    gen = _CudaLikeGenerator(5)
    keys = [_step_seed(gen) for _ in range(4)]
    assert len(set(keys)) == 4 and gen.offset == 16
    again = _CudaLikeGenerator(5)
    assert [_step_seed(again) for _ in range(4)] == keys
    assert _step_seed(_CudaLikeGenerator(6)) != keys[0]
    assert all(0 <= k < 1 << 64 for k in keys)


def test_through_the_kernel_a_cpu_seeded_rows_successive_draws_take_successive_keys(monkeypatch):
    """A seeded top-p row drawn by the kernel takes each draw's key from its generator: 16 draws over 64 equally
    likely tokens are not all one token, and a fresh generator of the seed repeats them (mutant K3: the key was
    the seed itself, so every token of a seeded request was its first one)."""
    monkeypatch.setattr(sampling, "USE_KERNEL", True)
    logits = torch.zeros(1, 64)

    def draws() -> list[int]:
        gen = seeded_generator(11, CPU)
        return [int(sample(logits, [1.0], [0.99], [gen])[0]) for _ in range(16)]
    first = draws()
    assert len(set(first)) > 1 and draws() == first


def test_logits_whose_columns_are_not_contiguous_are_drawn_by_the_torch_path(monkeypatch):
    """The kernel reads a row's tokens at stride 1: a view whose columns are strided (here a transposed table) is
    drawn by the sort instead, and top_k 1 still gives each row's argmax (mutant K4: such a view went to the
    kernel, which read other rows' logits)."""
    monkeypatch.setattr(sampling, "USE_KERNEL", True)
    table = torch.randn(24, 3, generator=torch.Generator().manual_seed(4)) * 3
    logits = table.t()  # [3, 24], stride (1, 3)
    ids = sample(logits, [1.0] * 3, [1.0] * 3, [None] * 3, [1] * 3)
    assert ids.tolist() == logits.argmax(dim=-1).tolist()
