"""MoE kernels against float64 loops: grouped matmuls (every impl; Pallas in interpret mode
with NaN-poisoned outputs), the fused gather / combine variants and whole routed-expert
layers, forward and every gradient, with empty experts, one expert taking every row, row
counts not divisible by the block size, f32 and bf16.

Inputs are fresh on every run (tests/numerics.py: K2JAX_TEST_SEED replays one); each element
is held to a rounding bound from the inputs' magnitudes and the dots' widths (float32
accumulation: gamma(width) times the float64 sum of |terms|), never a bare tolerance."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax.kernels import gmm as gm
from k2jax.kernels import moe
from tests.numerics import U16, U32, assert_within, gamma, replay, seed_and_rng

SIZES = [[3, 0, 5, 2], [0, 0, 7], [1] * 9, [40, 1, 0, 25], [0, 70, 0]]
PALLAS = ("pallas_gpu", "megablox")


def _impls():
  out = []
  for impl in gm.IMPLS:
    if impl == "tokamax":
      try:
        import tokamax  # noqa: F401
      except ImportError:
        continue
    out.append(impl)
  # blocked at each size blocked_block_size can pick (auto picks 32 at these small shapes)
  return out + [f"blocked/{b}" for b in gm._ROW_COST]


def _loop(x, w, sizes, rows=None):
  """float64 y[r] = x[rows[r]] @ w[g(r)] for rows r sorted by group; trailing rows 0. With
  |x| and |w| it gives each element's sum of |terms|, the magnitude its bound scales."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  rows = np.arange(sum(sizes)) if rows is None else np.asarray(rows)
  out, start = np.zeros((len(rows) if rows is not None else x.shape[0], w.shape[2])), 0
  for g, n in enumerate(sizes):
    out[start:start + n] = x[rows[start:start + n]] @ w[g]
    start += n
  return out


def _f32(a):
  """a rounded to float32, as float64: what the kernel is given, and the reference uses."""
  return np.asarray(np.asarray(a, np.float32), np.float64)


@functools.lru_cache(maxsize=None)
def _grouped_matmul_vjp(impl):
  """jit((x, w, group_sizes, cot) -> (y, dx, dw)), one per impl, so that repeated draws
  (tests/numerics.py) reuse the compiled kernels."""
  if impl == "tokamax_ours_dw":
    run = lambda x, w, gs: gm.tokamax_ours_dw(x, w, gs, True)
  elif impl.startswith("blocked/"):
    run = lambda x, w, gs: gm.grouped_matmul_blocked(x, w, gs, block=int(impl.split("/")[1]))
  else:
    run = lambda x, w, gs: gm.grouped_matmul(x, w, gs, impl=impl, interpret=True)

  def f(x, w, gs, cot):
    y, vjp = jax.vjp(lambda x, w: run(x, w, gs), x, w)
    return y, *vjp(cot)
  return jax.jit(f)


def _check_grouped_matmul(impl, sizes, K, N):
  """y = x_g @ w_g (width K), dx = cot_g @ w_g^T (width N), dw_g = x_g^T cot_g (width the
  group's rows) against float64, each element within gamma(width) times its sum of |terms|
  (f32 accumulation in any order: tests/numerics.py); trailing rows and empty groups exactly
  0 (their bound is 0)."""
  seed, rng = seed_and_rng()
  M = sum(sizes) + 3                          # trailing rows outside every group must give 0
  G = len(sizes)
  x, w = _f32(rng.standard_normal((M, K))), _f32(rng.standard_normal((G, K, N)))
  cot = _f32(rng.standard_normal((M, N)))
  y, gx, gw = _grouped_matmul_vjp(impl)(*(jnp.asarray(a, jnp.float32) for a in (x, w)),
                                        jnp.asarray(sizes, jnp.int32),
                                        jnp.asarray(cot, jnp.float32))
  want, mag = np.zeros((M, N)), np.zeros((M, N))
  want[:sum(sizes)], mag[:sum(sizes)] = _loop(x, w, sizes), _loop(abs(x), abs(w), sizes)
  assert_within(f"{impl} {sizes} y", y, want, gamma(K) * mag, seed)
  wT = np.swapaxes(w, 1, 2)
  want_gx, mag_gx = np.zeros((M, K)), np.zeros((M, K))
  want_gx[:sum(sizes)] = _loop(cot, wT, sizes)
  mag_gx[:sum(sizes)] = _loop(abs(cot), abs(wT), sizes)
  assert_within(f"{impl} {sizes} dx", gx, want_gx, gamma(N) * mag_gx, seed)
  want_gw, bound_gw, start = np.zeros((G, K, N)), np.zeros((G, K, N)), 0
  for g, n in enumerate(sizes):
    want_gw[g] = x[start:start + n].T @ cot[start:start + n]
    bound_gw[g] = gamma(n) * (abs(x[start:start + n]).T @ abs(cot[start:start + n]))
    start += n
  assert_within(f"{impl} {sizes} dw", gw, want_gw, bound_gw, seed)


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_matmul_forward_and_gradients_match_loop(impl, sizes):
  # Mosaic (megablox) tiles need feature dims in multiples of 16; pallas_gpu pads odd ones
  # itself, so it is tested at odd widths like the XLA paths. Row counts are odd everywhere.
  K, N = (32, 48) if impl == "megablox" else (5, 7)
  _check_grouped_matmul(impl, sizes, K, N)


@pytest.mark.parametrize("sizes", SIZES[:4])
def test_tokamax_gpu_path_forward_and_gradients_match_loop(sizes):
  """impl="tokamax" on a GPU: tokamax's ragged dot for y and dx, our tgmm for dw (tokamax's
  Mosaic dw was wrong on the H100). Run here with tokamax's XLA kernel and our tgmm in
  interpret mode, at odd widths (padded to 16 for the Triton tiles) and trailing rows."""
  pytest.importorskip("tokamax")
  _check_grouped_matmul("tokamax_ours_dw", sizes, 5, 7)


@functools.lru_cache(maxsize=None)
def _fused_vjps(impl, variant=None):
  """jit'd (gather_grouped_matmul and its vjp, grouped_matmul_combine and its vjp), one
  pair per variant: jit keeps its trace when a test changes module tables (tiles, backward
  kernels), so a shared pair would run the first variant's kernels for all of them."""
  def gather(x, w, gs, row_ids, cot):
    h, vjp = jax.vjp(lambda x, w: gm.gather_grouped_matmul(x, w, gs, row_ids, impl=impl,
                                                           interpret=True), x, w)
    return h, *vjp(cot)

  def combine(h, w, gs, slots, scale, cot):
    y, vjp = jax.vjp(lambda h, w, s: gm.grouped_matmul_combine(h, w, gs, slots, s, impl=impl,
                                                               interpret=True), h, w, scale)
    return y, *vjp(cot)
  return jax.jit(gather), jax.jit(combine)


# pallas_gpu's tiles: its defaults, and small ones whose row tiles differ between the output
# rows (gmm: 16) and the weight gradients' reduction (tgmm: 32), so groups span several tiles
# of each and widths several blocks.
SMALL_TILES = {"gmm": (16, 32, 16, 4, 2), "tgmm": (32, 16, 16, 4, 2)}


def _mgpu_stand_ins(monkeypatch):
  """moe_gpu's backward and combine on their "mgpu" path, jax's Mosaic GPU kernels (Hopper) replaced
  by float32 ragged dots with their contract: rows sorted by group, rows past the groups
  left unwritten (NaN here, so a product that reads them fails), weight gradients summed
  over each group's rows. What this checks is k2jax's side: the gathers that make rows
  contiguous, the masking, the scaling, the scatter to token order and the segment sums
  around the two kernels."""
  from k2jax.kernels import moe_gpu
  hi = jax.lax.Precision.HIGHEST

  def ragged_dot(lhs, rhs, *, group_sizes, transpose_rhs=False, **_):
    rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    y = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes,
                           precision=hi)
    inside = jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(inside[:, None], y, jnp.nan).astype(lhs.dtype)

  def transposed(lhs, rhs, *, group_sizes, **_):
    dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                                      group_sizes, dn, precision=hi).astype(lhs.dtype)
  monkeypatch.setattr(moe_gpu, "_mgpu_ops", lambda: (ragged_dot, transposed))
  monkeypatch.setattr(moe_gpu, "FORCE", {"backward": "mgpu", "combine": "mgpu"})


@pytest.mark.parametrize("impl,tiles", [("blocked", None), ("pallas_gpu", None),
                                        ("pallas_gpu", "small"), ("pallas_gpu", "by_size"),
                                        ("pallas_gpu", "mgpu")])
def test_fused_gather_and_combine_variants(impl, tiles, monkeypatch):
  """gather_grouped_matmul reads x through row ids; grouped_matmul_combine writes rows to
  their slots scaled by weights; both against float64, with their three gradients, each
  element within gamma(width) times its sum of |terms| (f32 accumulation). "by_size": the
  forward kernel's tiles from moe_gpu.TUNING_BY_SIZE, the weight gradients' from TUNING.
  "mgpu": the backward's and the combine's Hopper path around jax's kernels
  (`_mgpu_stand_ins`)."""
  from k2jax.kernels import moe_gpu
  if tiles == "mgpu":
    _mgpu_stand_ins(monkeypatch)
  if tiles == "small":
    monkeypatch.setattr(moe_gpu, "TUNING", SMALL_TILES)
  if tiles == "by_size":
    monkeypatch.setattr(moe_gpu, "TUNING", dict(moe_gpu.TUNING, tgmm=SMALL_TILES["tgmm"]))
    monkeypatch.setattr(moe_gpu, "TUNING_BY_SIZE", {1: {"gmm": SMALL_TILES["gmm"]}})
    assert moe_gpu.tiles_for("gmm", 21, 40) == SMALL_TILES["gmm"]
  seed, rng = seed_and_rng()
  gather, combine = _fused_vjps(impl, tiles)
  sizes = [11, 0, 37, 1, 0]
  M, Nt, K, F = sum(sizes), 29, 21, 40      # neither width a multiple of 16
  x = _f32(rng.standard_normal((Nt, K)))
  w = _f32(rng.standard_normal((len(sizes), K, F)))
  row_ids = rng.integers(0, Nt, M)          # tokens repeat (top-k)
  cot = _f32(rng.standard_normal((M, F)))
  gs = jnp.asarray(sizes, jnp.int32)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  h, gx, gw = gather(f32(x), f32(w), gs, jnp.asarray(row_ids, jnp.int32), f32(cot))
  assert_within(f"{impl} gather y", h, _loop(x, w, sizes, row_ids),
                gamma(K) * _loop(abs(x), abs(w), sizes, row_ids), seed)
  want_gx, mag_gx, want_gw, bound_gw, start = np.zeros((Nt, K)), np.zeros((Nt, K)), \
      np.zeros(w.shape), np.zeros(w.shape), 0
  for g, n in enumerate(sizes):
    r = row_ids[start:start + n]
    np.add.at(want_gx, r, cot[start:start + n] @ w[g].T)
    np.add.at(mag_gx, r, abs(cot[start:start + n]) @ abs(w[g]).T)
    want_gw[g] = x[r].T @ cot[start:start + n]
    bound_gw[g] = gamma(n) * (abs(x[r]).T @ abs(cot[start:start + n]))
    start += n
  # a token's dx sums F terms for each of its assignments
  width_gx = F * np.bincount(row_ids, minlength=Nt)[:, None]
  assert_within(f"{impl} gather dx", gx, want_gx, gamma(width_gx) * mag_gx, seed)
  assert_within(f"{impl} gather dw", gw, want_gw, bound_gw, seed)

  w2 = _f32(rng.standard_normal((len(sizes), F, K)))
  hh = _f32(rng.standard_normal((M, F)))
  slots = rng.permutation(M)
  scale = _f32(rng.uniform(0.1, 2.0, M))
  cot = _f32(rng.standard_normal((M, K)))
  y, gh, gw2, gs_ = combine(f32(hh), f32(w2), gs, jnp.asarray(slots, jnp.int32), f32(scale),
                            f32(cot))
  z, mag_z = _loop(hh, w2, sizes), _loop(abs(hh), abs(w2), sizes)
  sc = scale[:, None]
  want, bound = np.zeros((M, K)), np.zeros((M, K))
  want[slots], bound[slots] = z * sc, gamma(F + 1) * mag_z * sc     # + the scaling's rounding
  assert_within(f"{impl} combine y", y, want, bound, seed)
  c = cot[slots]                                                # cotangent per sorted row
  # d scale_r = c_r . z_r: K terms, each carrying z's F-term error
  assert_within(f"{impl} combine dscale", gs_, np.sum(c * z, 1),
                gamma(F + K) * np.sum(abs(c) * mag_z, 1), seed)
  want_gh, bound_gh, want_gw2, bound_gw2, start = np.zeros((M, F)), np.zeros((M, F)), \
      np.zeros(w2.shape), np.zeros(w2.shape), 0
  for g, n in enumerate(sizes):
    sl = slice(start, start + n)
    want_gh[sl] = sc[sl] * (c[sl] @ w2[g].T)
    bound_gh[sl] = gamma(K + 1) * sc[sl] * (abs(c[sl]) @ abs(w2[g]).T)
    want_gw2[g] = (sc[sl] * hh[sl]).T @ c[sl]
    bound_gw2[g] = gamma(n + 1) * (sc[sl] * abs(hh[sl])).T @ abs(c[sl])
    start += n
  assert_within(f"{impl} combine dh", gh, want_gh, bound_gh, seed)
  assert_within(f"{impl} combine dw", gw2, want_gw2, bound_gw2, seed)


def _dense64(x, ids, comb, gate, up, down):
  """The routed layer by a loop over tokens and choices, in float64 (complex128 for complex
  inputs: the complex-step check below)."""
  dt = np.result_type(*(np.asarray(a) for a in (x, comb, gate, up, down)), np.float64)
  x, comb, gate, up, down = (np.asarray(a, dt) for a in (x, comb, gate, up, down))
  silu = lambda a: a / (1 + np.exp(-a))
  y = np.zeros_like(x)
  for n in range(x.shape[0]):
    for j, e in enumerate(np.asarray(ids)[n]):
      y[n] += comb[n, j] * ((silu(x[n] @ gate[e]) * (x[n] @ up[e])) @ down[e])
  return y


# |silu'| <= 1.0998, |sigmoid'| <= 1/4 and |silu''| <= 1/2 everywhere: how far an error in
# their input moves silu, sigmoid and silu's derivative.
SILU_LIP, SIGMOID_LIP, SILU_D_LIP = 1.1, 0.25, 0.5


def _experts64(x, ids, comb, gate, up, down, cot, u_acc, u_store):
  """The routed layer in float64, vectorized over the N k assignments r = (n, j), expert e:
  a = x_n gate_e, b = x_n up_e, h = silu(a) b, y_n = sum_j comb_nj h down_e; the gradients
  of sum(y cot) in closed form (the complex-step test below checks them); and per element a
  first-order bound on an implementation's error (tests/numerics.py) when its dots accumulate
  with unit roundoff u_acc (a width-n dot: gamma(n) sum |terms|) and every value it computes
  may be rounded once with unit roundoff u_store (float32: both 2^-24; bf16 inputs: f32
  accumulation, each stored value, and each elementwise step XLA runs in bf16, rounded to
  bf16). Each step's bound is the propagated bounds of its inputs (through silu / sigmoid
  with their Lipschitz constants) plus its own rounding."""
  x, comb, gate, up, down, g = (np.asarray(a, np.float64) for a in (x, comb, gate, up, down, cot))
  N, k = ids.shape
  n, e, c = np.repeat(np.arange(N), k), np.asarray(ids).reshape(-1), comb.reshape(-1)[:, None]
  X, Ga, Up, Dn, gn = x[n], gate[e], up[e], down[e], g[n]
  mm = lambda a, w: np.einsum("rd,rdf->rf", a, w)            # row r times its expert's w
  mmT = lambda a, w: np.einsum("rf,rdf->rd", a, w)           # ... times w^T
  outer = lambda a, b: np.einsum("rd,rf->rdf", a, b)
  ud, us, A = (lambda n: gamma(n, u_acc)), u_store, np.abs

  def per_token(v):
    out = np.zeros((N,) + v.shape[1:])
    np.add.at(out, n, v)
    return out

  def per_expert(v, like):
    out = np.zeros(like.shape)
    np.add.at(out, e, v)
    return out

  a, b = mm(X, Ga), mm(X, Up)
  sg = 1 / (1 + np.exp(-a))
  s = a * sg
  h = s * b
  z = mm(h, Dn)
  dz = c * gn
  dh = mm(dz, np.swapaxes(Dn, 1, 2))
  ds = dh * b
  da, db = ds * sg * (1 + a * (1 - sg)), dh * s
  want = {"y": per_token(c * z), "dx": per_token(mmT(da, Ga) + mmT(db, Up)),
          "dcombine": np.sum(gn * z, 1).reshape(N, k), "dgate": per_expert(outer(X, da), gate),
          "dup": per_expert(outer(X, db), up), "ddown": per_expert(outer(h, dz), down)}

  d, f = x.shape[1], gate.shape[2]
  ea = ud(d) * mm(A(X), A(Ga)) + us * A(a)
  eb = ud(d) * mm(A(X), A(Up)) + us * A(b)
  # sigmoid = 1 / (1 + exp(-a)): three roundings, each relative to sigmoid; plus 4 f32 ulp
  # absolute in case an expansion goes through tanh
  esg_own = 3 * us * sg + 4 * min(us, U32)
  es = A(sg) * ea + A(a) * (SIGMOID_LIP * ea + esg_own) + us * A(s)
  eh = A(b) * es + A(s) * eb + us * A(h)
  ez = mm(eh, A(Dn)) + ud(f) * mm(A(h), A(Dn)) + us * A(z)
  # y: k products summed per token (and a bf16 sum may round after each of them)
  ey = per_token(A(c) * ez + (ud(k + 1) + k * us) * A(c * z)) + us * A(want["y"])
  edz = us * A(dz)
  DnT = np.swapaxes(A(Dn), 1, 2)
  edh = (ud(d) + us) * mm(A(dz), DnT) + us * A(dh)
  eds = A(b) * edh + A(dh) * eb + us * A(ds)
  # da = ds sigmoid + ds a sigmoid (1 - sigmoid) as autodiff forms it: ds's error times
  # |silu'|, a's error through silu'' and sigmoid's own roundings, five roundings of its own
  eda = (SILU_LIP * eds + A(ds) * (SILU_D_LIP * ea + (1 + A(a)) * esg_own)
         + 5 * us * A(ds) * sg * (1 + A(a) * (1 - sg)) + us * A(da))
  edb = A(s) * edh + A(dh) * es + us * A(db)
  terms_dx = mmT(A(da), A(Ga)) + mmT(A(db), A(Up))
  partials_dx = A(mmT(da, Ga)) + A(mmT(db, Up))     # the 2 k dots a token's dx sums
  bound = {
      "y": ey,
      "dcombine": (np.sum(A(gn) * ez, 1) + ud(d) * np.sum(A(gn * z), 1)).reshape(N, k)
                  + us * A(want["dcombine"]),
      # dx: 2 f k terms per token in f32; the 2 k dots' results may each be rounded and
      # summed in bf16 (2 k roundings, each at most the sum of their magnitudes)
      "dx": per_token(mmT(eda, A(Ga)) + mmT(edb, A(Up)) + ud(2 * f * k) * terms_dx
                      + 2 * k * us * partials_dx) + us * A(want["dx"]),
      # weight gradients: sums over an expert's rows (at most N k) in f32
      "dgate": per_expert(outer(A(X), eda) + ud(N * k) * outer(A(X), A(da)), gate)
               + us * A(want["dgate"]),
      "dup": per_expert(outer(A(X), edb) + ud(N * k) * outer(A(X), A(db)), up)
             + us * A(want["dup"]),
      "ddown": per_expert(outer(eh, A(dz)) + outer(A(h), edz) + ud(N * k) * outer(A(h), A(dz)),
                          down) + us * A(want["ddown"]),
  }
  return want, bound


# First-order bounds: products of two errors (< 5% each in bf16, < 1e-4 in f32) are dropped;
# 1.25 covers them.
SLACK = 1.25


@functools.lru_cache(maxsize=None)
def _routed_vjp(impl):
  """jit((x, ids, combine, gate, up, down, cot) -> (y, d x, d combine, d gate, d up, d down))."""
  def f(x, ids, c, g, u, dn, cot):
    if impl.startswith("blocked/"):   # the blocked path at a block other than its own pick
      run = lambda x, c, g, u, dn: moe._blocked(x, ids, c, g, u, dn,
                                                block=int(impl.split("/")[1]))
    else:                             # "pallas_gpu/mgpu": the caller set _mgpu_stand_ins
      run = lambda x, c, g, u, dn: moe.routed_experts(x, ids, c, g, u, dn,
                                                      impl=impl.split("/")[0], interpret=True)
    y, vjp = jax.vjp(run, x, c, g, u, dn)
    return y, *vjp(cot)
  return jax.jit(f)


@pytest.mark.parametrize("impl", ["blocked", "blocked/32", "blocked/128", "ragged", "capacity",
                                  "pallas_gpu", "pallas_gpu/mgpu", "dense"])
@pytest.mark.parametrize("routing", ["spread", "one_expert_takes_all"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_routed_experts_match_float64(impl, routing, dtype, monkeypatch):
  if impl == "pallas_gpu/mgpu":     # the Hopper path, gate and up sharing one backward
    _mgpu_stand_ins(monkeypatch)
  seed, rng = seed_and_rng()
  N, d, f, E, k = 37, 24, 40, 6, 2          # widths not multiples of 16 (pallas_gpu pads)
  x = rng.standard_normal((N, d))
  gate, up = (rng.standard_normal((E, d, f)) * d ** -0.5 for _ in range(2))
  down = rng.standard_normal((E, f, d)) * f ** -0.5
  comb = rng.uniform(0.2, 1.0, (N, k))
  if routing == "spread":   # expert 5 never chosen: an empty group
    ids = np.stack([rng.permutation(N) % 5, (rng.permutation(N) + 1) % 5], 1)
  else:                     # every token's first choice is expert 2: capacity overflows
    ids = np.stack([np.full(N, 2), rng.integers(0, E, N)], 1)
  ids = np.where(ids[:, :1] == ids[:, 1:], np.stack([ids[:, 0], (ids[:, 1] + 1) % E], 1), ids)
  cot = rng.standard_normal((N, d))
  args = [jnp.asarray(a, dtype) for a in (x, comb, gate, up, down, cot)]
  # the reference sees what the kernel sees: the inputs and cotangent rounded to dtype
  x, comb, gate, up, down, cot = (np.asarray(a.astype(jnp.float32)) for a in args)
  want, bound = _experts64(x, ids, comb, gate, up, down, cot, u_acc=U32,
                           u_store=U32 if dtype == jnp.float32 else U16)
  got = _routed_vjp(impl)(args[0], jnp.asarray(ids, jnp.int32), *args[1:])
  for name, g in zip(("y", "dx", "dcombine", "dgate", "dup", "ddown"), got):
    assert g.dtype == dtype, (name, g.dtype, replay(seed))
    assert_within(f"{impl} {routing} {jnp.dtype(dtype).name} {name}", g.astype(jnp.float32),
                  want[name], SLACK * bound[name], seed)


def test_float64_reference_gradients_match_complex_step():
  """_experts64's closed-form gradients, the reference above, against the complex-step
  derivative of the loop (_dense64 at inputs + i h v: Im / h is the directional derivative
  with no subtractive cancellation, and its O(h^2) truncation is nil at h = 1e-30), in a
  random direction per input; both in float64, so within twice the float64 rounding bound."""
  seed, rng = seed_and_rng()
  N, d, f, E, k = 5, 4, 6, 3, 2
  x, comb = rng.standard_normal((N, d)), rng.uniform(0.2, 1, (N, k))
  gate, up, down = rng.standard_normal((E, d, f)), rng.standard_normal((E, d, f)), rng.standard_normal((E, f, d))
  ids = np.stack([np.arange(N) % E, (np.arange(N) + 1) % E], 1)
  cot = rng.standard_normal((N, d))
  # complex arithmetic rounds up to 4 times (a complex product) where real arithmetic
  # rounds once: the loop's bound at 4 float64 units covers both computations
  u64 = 4 * 2.0 ** -53
  want, bound = _experts64(x, ids, comb, gate, up, down, cot, u_acc=u64, u_store=u64)
  base = [x, comb, gate, up, down]
  h = 1e-30
  for i, name in enumerate(("dx", "dcombine", "dgate", "dup", "ddown")):
    v = rng.standard_normal(base[i].shape)
    moved = [b + 1j * h * v if j == i else b for j, b in enumerate(base)]
    cs = float(np.sum(_dense64(moved[0], ids, *moved[1:]) * cot).imag / h)
    # the closed form's bound, as much for the loop's (the same operations, reordered), and
    # the final dot with v
    assert_within(f"d/d{name[1:]} . v", np.sum(want[name] * v), cs,
                  SLACK * np.sum((2 * bound[name] + gamma(v.size, u64) * abs(want[name]))
                                 * abs(v)), seed)


_PREPARE = """
import sys
import jax, jax.numpy as jnp
from jax._src import config as jax_config
from k2jax import kernels
if sys.argv[1] == "prepare":
  kernels.prepare("tokamax", "auto")
before = len(jax_config.trace_context())
q = jnp.ones((1, 16, 2, 8)); v = jnp.ones((1, 16, 2, 4))
f = jax.jit(lambda q, k, v: kernels.attention(q, k, v, scale=0.3, impl="tokamax")[0].sum())
for _ in range(3):
  f(q, q, v).block_until_ready()
print("RESULT", before, len(jax_config.trace_context()), f._cache_size())
"""


def test_prepare_imports_the_kernel_libraries_before_the_first_trace():
  """kernels.prepare before jit: a jitted call through tokamax traces and compiles once. In a
  fresh interpreter whose first import of tokamax happens inside the trace, jax >= 0.11 gets
  six new trace-context values from that import, and the function's second call compiles
  again (measured with jax 0.11.2: 2 cache entries; on the H100 an 18 s compile of the bench
  step's second call); jax 0.10 (this CI) registers none."""
  pytest.importorskip("tokamax")
  import subprocess
  import sys
  runs = {}
  for mode in ("prepare", "lazy"):
    out = subprocess.run([sys.executable, "-c", _PREPARE, mode], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))
    runs[mode] = [int(x) for x in line.split()[1:]]
  before, after, entries = runs["prepare"]
  assert after == before and entries == 1, runs
  before, after, entries = runs["lazy"]
  # the failure prepare exists for, where this jax has it: one more entry per changed context
  assert entries == (1 if after == before else 2), runs


def test_grouped_matmul_tiles_follow_the_expert_matrix_size(monkeypatch):
  """moe_gpu.tiles_for: TUNING below every size entry, the largest entry that applies
  above (K N elements of one expert's matrix, whichever way round)."""
  from k2jax.kernels import moe_gpu
  a, b, c = (64, 32, 32, 4, 2), (128, 64, 64, 8, 3), (256, 64, 64, 8, 3)
  monkeypatch.setattr(moe_gpu, "TUNING", {"gmm": a, "tgmm": a})
  monkeypatch.setattr(moe_gpu, "TUNING_BY_SIZE", {100 * 100: {"gmm": b}, 300 * 300: {"gmm": c}})
  assert moe_gpu.tiles_for("gmm", 99, 100) == a
  assert moe_gpu.tiles_for("gmm", 100, 100) == moe_gpu.tiles_for("gmm", 50, 200) == b
  assert moe_gpu.tiles_for("gmm", 900, 100) == c and moe_gpu.tiles_for("tgmm", 900, 100) == a
  assert moe_gpu._bm("gmm", 900, 100) == 256


@pytest.mark.parametrize("in_shard_map", [False, True])
@pytest.mark.parametrize("roles", [("backward",), ("backward", "combine")])
def test_mgpu_backward_lowers_for_cuda(roles, in_shard_map, monkeypatch):
  """The routed experts' gradient on moe_gpu's Hopper path lowers for CUDA here (no GPU):
  the forward's three products as Triton kernels (the down projection as jax's Mosaic GPU
  kernel when "combine" is forced too), the backward's six (two per projection) as jax's
  Mosaic GPU kernels; also inside shard_map with its manual-axis checks on, as the
  expert-parallel layer runs it (the kernels' outputs declare no manual axes:
  pallas_utils.foreign_kernel). There the weights are replicated and the rows split, so
  each weight gradient must be summed over the axis: three all-reduces, which an output
  taken as the same on every device would silently skip. jax's weight-gradient kernel asks
  the device for its SM count, which a CPU device lacks: the stand-in gives 132 (H100)."""
  import re
  from jax.sharding import PartitionSpec as P
  from k2jax.kernels import moe_gpu, platform
  monkeypatch.setattr(moe_gpu, "FORCE", {r: "mgpu" for r in roles})
  N, d, f, E, k = 64, 256, 128, 4, 2

  def loss(x, ids, comb, g, u, dn):   # squared: the backward reads the forward's output
    return jnp.sum(moe_gpu.routed_experts(x, ids, comb, g, u, dn).astype(jnp.float32) ** 2)
  grad = jax.grad(loss, argnums=(0, 3, 4, 5))
  specs = (P("expert"),) * 3 + (P(),) * 3
  shapes = [((N, d), jnp.bfloat16), ((N, k), jnp.int32), ((N, k), jnp.float32),
            ((E, d, f), jnp.bfloat16), ((E, d, f), jnp.bfloat16), ((E, f, d), jnp.bfloat16)]
  args = [jax.ShapeDtypeStruct(*s) for s in shapes]
  if in_shard_map:
    mesh = jax.make_mesh((1,), ("expert",))
    grad = jax.shard_map(grad, mesh=mesh, in_specs=specs, out_specs=(P("expert"), P(), P(), P()))
    args = [jax.ShapeDtypeStruct(*s, sharding=jax.NamedSharding(mesh, p))
            for s, p in zip(shapes, specs)]

  class Device:
    def __init__(self, real):
      self._real = real

    def __getattr__(self, name):
      return 132 if name == "core_count" else getattr(self._real, name)
  real = jax.devices
  monkeypatch.setattr(jax, "devices", lambda *a: [Device(x) for x in real(*a)])
  with platform.target("cuda"):
    text = jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  calls = re.findall(r"custom_call @([\w$.]+)", text)
  combine = "combine" in roles
  assert calls.count("__gpu$xla.gpu.triton") == 3 - combine, sorted(set(calls))
  assert calls.count("mosaic_gpu_v2") == 6 + combine, sorted(set(calls))
  assert text.count("all_reduce") == (3 if in_shard_map else 0)
