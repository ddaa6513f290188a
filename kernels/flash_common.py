"""What the attention kernels share (XLA's chunked loop here in flash.py, the Pallas GPU and
TPU kernels): the segment id of the padding to a block multiple, and the finish that puts
the output back in [B, T, H, Dv] with the per-head max logit over counted rows (QK-Clip's
S_max, report 2.1). A module of its own so the backends need not import the dispatcher that
imports them.
"""

import jax
import jax.numpy as jnp

PAD_SEGMENT = -1          # internal padding to a block multiple: matches no real segment


def finish(out, row_max, seg, T):
  """Back to [B, T, H, Dv] and the per-head max over counted rows (real segment, real row)."""
  counted = (seg > 0)[:, None, :]                                       # [B, 1, Tp]
  max_logits = jnp.max(jnp.where(counted, row_max, -jnp.inf), axis=(0, 2))
  return jnp.swapaxes(out, 1, 2)[:, :T], jax.lax.stop_gradient(max_logits)
