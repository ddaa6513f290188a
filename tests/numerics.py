"""Fresh seeds and rounding-error bounds for the randomized kernel tests.

Seeds: every run draws new inputs from os.urandom, so CI keeps exploring and a tolerance that
only holds for lucky inputs fails somewhere instead of never; K2JAX_TEST_SEED=<seed> replays
one. Each failure names its seed. (Python's hash() is randomized per process and was never
printed: a failure drawn from it could not be replayed.)

Bounds: a kernel is compared with float64 numpy on the same (rounded) inputs, element by
element, against a bound derived from those inputs (`assert_within`), never a bare rtol.
The building block is the classical one (Higham, Accuracy and Stability of Numerical
Algorithms, 2nd ed., Lemma 3.1 and eq. 3.5): a sum of n terms evaluated in floating point in
ANY order, each term a product carrying rounding errors, is off by at most

    gamma(n) * sum_i |a_i b_i|,   gamma(n) = n u / (1 - n u),

u the unit roundoff (2^-24 for float32, half of numpy's eps). Composite computations chain
it: an error |da| <= gamma(m) A with A >= |a| entering a dot of width n gives an error
<= gamma(m + n) (A @ |b|) (gamma(m) + gamma(n) + gamma(m) gamma(n) <= gamma(m + n)). The
magnitudes (A, |a| @ |b|, ...) are computed in float64 from the actual inputs, per element.
"""

import os

import numpy as np

ENV = "K2JAX_TEST_SEED"
U32 = 2.0 ** -24          # float32 unit roundoff
U16 = 2.0 ** -8           # bfloat16 unit roundoff (8 significant bits)

# Set by a repeated-draw driver to collect (what, max |err| / bound) per assertion; None in
# the suite.
record = None


def seed_and_rng():
  """-> (seed, numpy Generator): fresh from os.urandom, or K2JAX_TEST_SEED to replay."""
  given = os.environ.get(ENV)
  seed = int(given) if given else int.from_bytes(os.urandom(8), "little")
  return seed, np.random.default_rng(seed)


def replay(seed) -> str:
  return f"{ENV}={seed}"


def gamma(n, u=U32):
  """Higham's gamma_n: the relative bound of n roundings compounded (n u < 1)."""
  n = np.asarray(n, np.float64)
  assert np.all(n * u < 0.5)
  return n * u / (1 - n * u)


def assert_within(what, got, want, bound, seed):
  """Every element of `got` within `bound` (float64, broadcastable) of `want`. NaN (an
  unwritten, poisoned output) is outside any bound."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  bound = np.broadcast_to(np.asarray(bound, np.float64), want.shape)
  assert got.shape == want.shape, (what, got.shape, want.shape, replay(seed))
  err = np.abs(got - want)
  ok = err <= bound
  if record is not None:
    ratio = np.where(bound > 0, err / np.where(bound > 0, bound, 1), np.where(err > 0, np.inf, 0))
    record(what, float(np.nanmax(np.where(np.isnan(err), np.inf, ratio))) if err.size else 0.0)
  if not ok.all():
    worst = np.where(ok, -1.0, np.where(np.isnan(err), np.inf,
                                        err / np.maximum(bound, np.finfo(np.float64).tiny)))
    i = np.unravel_index(np.argmax(worst), worst.shape)
    raise AssertionError(
        f"{what}: {int((~ok).sum())} of {ok.size} elements outside the rounding bound; worst "
        f"at {tuple(int(j) for j in i)}: got {got[i]!r}, want {want[i]!r}, |err| {err[i]:.3g} "
        f"> bound {bound[i]:.3g} (replay: {replay(seed)})")
