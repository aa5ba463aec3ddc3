"""The float8 GEMMs' amax histories in checkpoints (`train.dtype = fp8`, delayed scaling).

A linear's history ([3, window]: the amaxes of its input, weight and output
gradient over the last steps, newest first; `ptc.ops.fp8_linear`; an experts'
grouped product's has a weight row per expert of the whole stack, an ep rank
recording its own experts', `ptc.ops.fp8_grouped`) is:

- replicated over tp: every amax is reduced (max) over the tp group, so it
  is the whole tensor's, the one an unsplit run records; any tp size reads
  it as it is;
- each rank's own over the gradient ranks (dp · cp): the inputs and output
  gradients it saw are of the rank's own samples (or sequence chunk);
- named the same on every stage: `fp8.layers_3_attn_q` is the linear's
  path, whichever pipeline stage holds it.

So a checkpoint keeps one history per linear and gradient rank r,
`fp8.amax_history.{r}.{linear}`, as a plain tensor: the tp ranks holding the
same one write the same key, and DCP writes it once. Loading under the same
dp and cp gives each rank its own history back, and the resumed run scales
as the uninterrupted one. Under another dp or cp a rank's samples are not
those of any saved rank, so it takes the elementwise max of every saved
rank's history: the largest amax any rank saw at each step, which saturates
no value that a saved rank's scale did not already cover. A window of
another length keeps its newest entries. A checkpoint without histories
(written without fp8) leaves them empty: the first step scales as current.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ptc.ops.fp8_linear import Fp8Scaling

PREFIX = "fp8.amax_history"


def scalings(trainer) -> dict[str, Fp8Scaling]:
    """The rank's float8 linears' scaling states by linear name (unique over the stages)."""
    return {name.removeprefix("fp8."): module for chunk in trainer.chunks.values()
            for name, module in chunk.gm.named_modules() if isinstance(module, Fp8Scaling)}


def key(rank: int, linear: str) -> str:
    """The checkpoint key of gradient rank `rank`'s history of `linear`."""
    return f"{PREFIX}.{rank}.{linear}"


def saved_histories(trainer) -> dict[str, torch.Tensor]:
    """What the rank writes: a host copy of each of its linears' histories."""
    return {key(trainer.dp_rank, linear): state.saved_history(trainer.device).detach().cpu()
            .clone() for linear, state in scalings(trainer).items()}


def history_reads(trainer, saved_layout: Mapping[str, int],
                  shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The saved histories this rank reads (key -> a tensor to load into): its own when the
    checkpoint's dp and cp are the plan's, else every saved rank's. `shapes`: the
    checkpoint's tensors by key; histories it lacks are left out."""
    par = trainer.plan.parallel
    saved_ranks = saved_layout.get("dp", 0) * saved_layout.get("cp", 1)
    same = (saved_layout.get("dp"), saved_layout.get("cp", 1)) == (par.dp, par.cp)
    ranks = [trainer.dp_rank] if same else range(saved_ranks)
    return {name: torch.zeros(shapes[name]) for linear in scalings(trainer) for r in ranks
            if (name := key(r, linear)) in shapes}


def restore_histories(trainer, loaded: Mapping[str, torch.Tensor]) -> int:
    """Give each linear the max of its loaded histories (`history_reads`); how many got one."""
    restored = 0
    for linear, state in scalings(trainer).items():
        mine = [value for name, value in loaded.items()
                if name.startswith(PREFIX + ".") and name.split(".", 3)[3] == linear]
        if mine:
            state.load_history(torch.stack(mine).amax(dim=0), trainer.device)
            restored += 1
    return restored
