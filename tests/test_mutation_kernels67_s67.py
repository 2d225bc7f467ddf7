"""Session 67's mutation check of the Triton kernels as they run on the CPU (TRITON_INTERPRET=1) and their host
side (kernels/chooser.py, page_copy.py, decode_attention.py, fused_ops.py, skinny_gemm.py, rejection_sampling.py):
rules no earlier test watched. The backend chooser's timing sample (capped at the pool, at least one page) and its
verification (the scatter checked too, a page list that is not the identity); Triton's availability off the GPU
(the interpreter variable); 16-bit attention's exact dots off the GPU; the norms' epsilon (inside the root; a
zero row stays zero) and the residual stream rounded before it is normed; SiLU's second column block; a skinny
projection of no rows; and the sampling kernel's acceptance: a likelier mass of exactly top_p is out, the
likeliest (a tie for it whole) is in whatever top_p rounds to, a top-k-only row is held to k by its count, the
k-th logit's floor is tempered, and a row's later races use the same uniforms in the round and finishing kernels."""
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import chooser, fused_ops, page_copy, skinny_gemm  # noqa: E402
from kernels.decode_attention import decode_attention_triton  # noqa: E402
from kernels.rejection_sampling import pack_params, sample_rows  # noqa: E402
from test_kernels import small_pool  # noqa: E402
from test_rejection_sampling import LOGITS, draw, reference  # noqa: E402


# ---- the backend chooser and page_copy's front door --------------------------------------------------

def test_auto_timing_of_more_sample_pages_than_the_pool_holds_times_the_whole_pool(monkeypatch):
    """A sample size past the pool's pages is cut to the pool (every page once), not a packed buffer of the
    asked size beside a shorter page list, which would fail and fall back to torch as if Triton were broken."""
    monkeypatch.setattr(chooser, "_timing_enabled", lambda l1: True)
    l1 = small_pool()
    c = chooser.choose_backends(l1, "auto", num_pages_sample=l1.shape[2] + 10, repeats=1)
    assert "fell back" not in c.reason, c.reason
    assert set(c.timings_us) == {"gather_triton", "gather_torch", "scatter_triton", "scatter_torch"}


def test_the_default_timing_sample_is_at_least_one_page_even_for_huge_pages(monkeypatch):
    """~64 MiB of pages, but never fewer than one (a page larger than the target still gets timed) and never
    more than the pool holds."""
    l1 = small_pool()
    page_bytes = l1[:, :, 0].numel() * l1.element_size()
    monkeypatch.setattr(chooser, "_SAMPLE_TARGET_BYTES", page_bytes - 1)
    assert chooser._default_sample_pages(l1) == 1
    monkeypatch.setattr(chooser, "_SAMPLE_TARGET_BYTES", 3 * page_bytes)
    assert chooser._default_sample_pages(l1) == 3
    monkeypatch.setattr(chooser, "_SAMPLE_TARGET_BYTES", 1 << 40)
    assert chooser._default_sample_pages(l1) == l1.shape[2]


def test_a_triton_scatter_that_writes_nothing_fails_verification(monkeypatch):
    """verify_triton checks the scatter as well as the gather: a scatter kernel that leaves the pool alone
    is caught (requested triton raises; auto falls back to torch)."""
    monkeypatch.setattr(page_copy, "scatter_pages_triton", lambda packed, ids, l1: None)
    with pytest.raises(RuntimeError, match="scatter disagrees"):
        chooser.choose_backends(small_pool(), "triton")


def test_a_gather_that_ignores_the_page_ids_fails_verification(monkeypatch):
    """The verification's page list is a permutation ([3, 0, 4], not 0, 1, 2): a kernel that copies the
    first n pages whatever the ids are is caught."""
    def first_pages(l1, ids, packed):
        packed.copy_(l1[:, :, : ids.numel()].permute(2, 0, 1, 3, 4, 5))

    monkeypatch.setattr(page_copy, "gather_pages_triton", first_pages)
    with pytest.raises(RuntimeError, match="gather disagrees"):
        chooser.choose_backends(small_pool(), "triton")


def test_triton_is_unavailable_on_a_cpu_when_the_interpreter_variable_is_off(monkeypatch):
    """Without CUDA the kernels run only interpreted, which TRITON_INTERPRET=1 asks for: with the variable
    off (the kernel object alone looks interpreted) Triton is reported unavailable."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert page_copy.triton_available()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not page_copy.triton_available()


# ---- paged decode attention ---------------------------------------------------------------------------

def test_16_bit_attention_off_the_gpu_uses_exact_float32_dots_by_default():
    """Tensor-core dots (probabilities rounded to the input dtype) are the default for 16-bit inputs on CUDA
    only: off the GPU a float16 call computes as tensor_cores=False does, bit for bit."""
    g = torch.Generator().manual_seed(8)
    k, v = torch.randn(6, 4, 1, 16, generator=g).half(), torch.randn(6, 4, 1, 16, generator=g).half()
    q = torch.randn(1, 2, 16, generator=g).half()
    tables, lens = torch.tensor([[4, 1, 5, 0]]), torch.tensor([14])
    got = decode_attention_triton(q, k, v, tables, lens, 0.25)
    assert torch.equal(got, decode_attention_triton(q, k, v, tables, lens, 0.25, tensor_cores=False))


# ---- fused norm / RoPE / SiLU and the skinny projections ---------------------------------------------

def test_the_norms_add_their_epsilon_inside_the_root_and_a_zero_row_stays_zero():
    """rmsnorm is x / sqrt(mean(x^2) + eps) * w: a large eps shows where it goes (inside the root, after the
    mean), and an all-zero row (a zero embedding, a zero head) gives zeros, not 0 / 0 = NaN."""
    g = torch.Generator().manual_seed(31)
    x = torch.randn(3, 48, generator=g) * 0.3
    x[1] = 0.0
    w = torch.randn(48, generator=g)
    y, _ = fused_ops.add_rms_norm_triton(x, None, w, 0.5)
    torch.testing.assert_close(y, fused_ops.add_rms_norm_torch(x, None, w, 0.5)[0], rtol=1e-5, atol=1e-6)
    assert y[1].eq(0).all()
    d, heads, kv_heads, tokens = 16, 2, 1, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g) * 0.3
    qkv[1] = 0.0
    qw, kw = torch.randn(d, generator=g), torch.randn(d, generator=g)
    cos, sin = torch.ones(8, d), torch.zeros(8, d)  # RoPE at angle 0: the norm alone
    pos, slots = torch.tensor([0, 1, 2]), torch.tensor([2, 0, 1])
    caches = [torch.zeros(1, 4, kv_heads, d) for _ in range(4)]
    q = fused_ops.qk_norm_rope_kv_triton(qkv, qw, kw, 0.5, cos, sin, pos, caches[0], caches[1], slots, heads, kv_heads)
    q_ref = fused_ops.qk_norm_rope_kv_torch(qkv, qw, kw, 0.5, cos, sin, pos, caches[2], caches[3], slots, heads,
                                            kv_heads)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(caches[0], caches[2], rtol=1e-5, atol=1e-6)
    assert q[1].eq(0).all() and caches[0].view(-1, kv_heads, d)[0].eq(0).all()


def test_the_norm_reads_the_residual_stream_as_stored_in_the_models_dtype():
    """x + residual is rounded to the model's dtype (the residual stream it returns) before it is normed: the
    output is exactly the norm of the returned stream, in float16 (which the interpreter rounds as the GPU
    does; its bfloat16 does not)."""
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(4, 256, generator=g) * 3).half()
    res = torch.randn(4, 256, generator=g).half()
    w = torch.randn(256, generator=g).half()
    y, s = fused_ops.add_rms_norm_triton(x, res, w, 1e-6)
    assert torch.equal(s, (x.float() + res.float()).half())
    y_ref, _ = fused_ops.add_rms_norm_torch(s.float(), None, w.float(), 1e-6)
    assert torch.equal(y, y_ref.half())


def test_silu_mul_covers_an_intermediate_size_past_one_block_with_a_ragged_tail():
    """An intermediate size over the 4,096-column block (not a multiple of it) takes a second column block:
    the tail's columns are computed too."""
    x = torch.randn(1, 2 * 4136, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(fused_ops.silu_mul_triton(x), fused_ops.silu_mul_torch(x), rtol=1e-5, atol=1e-5)


def test_a_skinny_projection_of_no_rows_is_refused():
    """1..MAX_ROWS rows: an empty input is an error naming the rows, not an empty launch."""
    with pytest.raises(ValueError, match="rows"):
        skinny_gemm.linear(torch.zeros(0, 64), torch.zeros(32, 64))


# ---- the sampling kernel's nucleus edge ------------------------------------------------------------

def test_a_token_whose_likelier_mass_is_exactly_top_p_is_outside_the_nucleus():
    """A candidate is kept only if the mass likelier than it is strictly below top_p of the kept mass. Two
    tokens weighing exactly 1 and 0.5 (the rest 0 in float32) with top_p = 2/3: the second's likelier mass, 1,
    equals top_p * 1.5 in float32, so it is out and every draw is the first (the reference's rule too)."""
    logits = torch.full((8,), -1000.0)
    logits[0], logits[1] = 0.0, math.log(0.5)  # exp: exactly 1 and 0.5
    n = 24
    ids = draw(logits.expand(n, -1), list(range(n)), 1.0, 2 / 3, 0.0, 0, list(range(500, 500 + n)))
    assert ids.eq(0).all(), ids
    assert reference(logits, 1.0, 2 / 3, 0.0, 0)[1] == 0


def test_a_top_p_that_float32_rounds_to_0_keeps_a_tie_for_the_likeliest_whole():
    """The likeliest is always accepted, whatever top_p * kept mass rounds to: with top_p 1e-50 (0 in float32)
    and two tokens tied for the largest logit, both are drawn (the tie kept whole, as at any nucleus edge),
    not only the first one the MAX_ROUNDS fallback would take."""
    logits = torch.tensor([2.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0])
    n = 16
    ids = draw(logits.expand(n, -1), list(range(n)), 1.0, 1e-50, 0.0, 0, list(range(900, 900 + n)), MAX_ROUNDS=2)
    assert set(ids.tolist()) == {0, 1}, ids
    assert reference(logits, 1.0, 1e-50, 0.0, 0)[:2].tolist() == [0.5, 0.5]


def test_a_top_k_row_without_its_kth_logit_is_held_to_k_by_its_count():
    """A row with top_k alone gets no k-th logit (`set_kth_logits` is for rows with top_p too): the kernel keeps
    it to k tokens by counting the likelier ones. top_k 2 at temperature 5 (a flat distribution) draws the two
    likeliest, both, and never the third."""
    n = 24
    params = pack_params(list(range(n)), [5.0] * n, [1.0] * n, [-math.inf] * n, [2] * n, list(range(300, 300 + n)))
    ids = sample_rows(LOGITS.expand(n, -1).contiguous(), params)
    assert set(ids.tolist()) == {0, 1}, ids


def test_top_k_with_top_p_at_a_temperature_takes_the_nucleus_of_the_tempered_top_k_set():
    """The k-th logit's floor is on the tempered scale, (kth - m) / T, like every token's x: at T = 2 the top-2
    set weighs 0.574 / 0.426, so top_p 0.5 keeps the likeliest alone (a floor left untempered would let the
    third token's mass into the top-k set's and keep the second)."""
    n = 24
    ids = draw(LOGITS.expand(n, -1), list(range(n)), 2.0, 0.5, 0.0, 2, list(range(700, 700 + n)))
    assert ids.eq(0).all(), ids
    assert reference(LOGITS, 2.0, 0.5, 0.0, 2)[1] == 0


def test_a_row_needing_several_rejections_draws_the_same_however_many_rounds_all_its_programs_share():
    """The r-th candidate's race uses the uniforms of round r + 1 (counters (r + 1) * V + token) in the round
    kernels and in the finishing one alike, so a flat row with a small top_p (several rejections, each over
    several likelier tokens) draws the same with 1 or 6 rounds shared by its programs."""
    g = torch.Generator().manual_seed(9)
    n = 8
    logits = torch.randn(n, 48, generator=g) * 0.3
    seeds = [77 + 13 * i for i in range(n)]
    one, six = (draw(logits, list(range(n)), 1.0, 0.15, 0.0, 0, seeds, BLOCK=16, CHUNK=64, ROUNDS=r) for r in (1, 6))
    assert one.equal(six), (one, six)
