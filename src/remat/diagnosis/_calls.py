"""What the doctor records of one checkpointed call: its key, where it was made, what ran inside it.

NOTE [Call keys]
A call is known by (call site, target, occurrence). The site is the first frame outside
torch and remat's checkpoint machinery; the target is the module's qualified name (a
module, its bound method, or a partial of either) or the function's qualified name; the
occurrence counts earlier calls with the same site and target since the model's forward
started, so loop iterations and ``checkpoint_sequential`` segments are told apart. Keys
are the same from one step to the next, which lets the doctor turn off one region at a
time. Calls made while backward runs are recomputations of an enclosing region: they
always run as written and are not counted.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from types import FrameType

import torch

# The module (``remat.checkpoint`` as an attribute is the function): remat's frames are known by its file.
from remat.core import checkpoint as remat_checkpoint

CallKey = tuple[str, str, int]
ROOT = "<root>"

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_REMAT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# remat's own step runners: reaching one means no user code called the checkpoint (a
# remat.wrap'd module inside torch's nn.Sequential, say), so there is no call site to show.
_RUNNERS = frozenset(
    os.path.join(_REMAT_DIR, wing, f)
    for wing, f in (("core", "_step.py"), ("core", "measure.py"), ("diagnosis", "doctor.py"))
)
# Libraries whose own gradient checkpointing calls torch's (``enable_gradient_checkpointing``).
_LIBRARIES = {"transformers": "Hugging Face", "diffusers": "diffusers"}


@dataclass
class CheckpointCall:
    """One checkpointed call in the forward of the observed step, filled in while it runs."""

    key: CallKey
    """(site, target, occurrence); see NOTE [Call keys]."""
    api: str
    """How the user checkpointed: ``torch.utils.checkpoint.checkpoint``, ``remat.wrap``, ..."""
    reentrant: bool
    """True for torch's reentrant implementation."""
    use_reentrant_unset: bool
    """True when the caller left ``use_reentrant`` unset (torch 2.13 then means True)."""
    preserve_rng_state: bool
    """Whether recomputation restores the RNG state of the forward."""
    inputs_require_grad: bool
    """Whether any tensor input requires grad."""
    depth: int
    """How many checkpointed calls enclose this one (0: top level)."""
    module_depth: int
    """Depth of the module call stack when the call began."""
    is_module: bool
    """True when the target is a module of the model (else a function's qualified name)."""
    output_requires_grad: bool | None = None
    """Whether any output tensor requires grad (reentrant calls only)."""
    top_modules: list[str] = field(default_factory=list)
    """Modules called directly inside the region."""
    modules: set[str] = field(default_factory=set)
    """Every module called inside the region in forward."""
    random_modules: set[str] = field(default_factory=set)
    """Modules (or ops, outside any module) that drew random numbers inside the region."""
    random_ops: int = 0
    """Random ops run inside the region in forward."""
    saved_random_ops: list[str] = field(default_factory=list)
    """Random ops whose outputs torch's selective checkpointing keeps (recompute then skips their draw)."""

    @property
    def site(self) -> str:
        return self.key[0]

    @property
    def target(self) -> str:
        return self.key[1]

    @property
    def module_names(self) -> tuple[str, ...]:
        """The modules this call checkpoints: the target, or the modules a function called directly."""
        return (self.target,) if self.is_module or not self.top_modules else tuple(dict.fromkeys(self.top_modules))

    @property
    def label(self) -> str:
        """The target for people: a module name, or the function with the modules it ran."""
        if self.is_module or not self.top_modules:
            return self.target
        names = self.module_names
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return shown if self.api.endswith("checkpoint_sequential") else f"{self.target} (runs {shown})"


def _short(path: str) -> str:
    cwd = os.getcwd() + os.sep
    return path[len(cwd) :] if path.startswith(cwd) else path


def call_site(machinery: frozenset[str]) -> tuple[str, str]:
    """(``file:line`` of the user's frame or "" when there is none, the checkpoint API it went through).

    Frames of the files in ``machinery`` (the doctor's interception, its wrappers) are skipped.
    """
    api = "torch.utils.checkpoint.checkpoint"
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        path = code.co_filename
        if path.startswith(_TORCH_DIR):
            if code.co_name == "checkpoint_sequential":
                api = "torch.utils.checkpoint.checkpoint_sequential"
            elif path.endswith("checkpoint_wrapper.py"):
                api = "torch checkpoint_wrapper"
            elif path.endswith("checkpoint_activation.py"):
                api = "torch.distributed._composable.checkpoint"
        elif path == remat_checkpoint.__file__:
            api = "remat.wrap" if code.co_qualname.startswith("_CheckpointedForward") else "remat.checkpoint"
        elif path in _RUNNERS:
            return "", api
        elif path not in machinery:
            # A Hugging Face layer's __call__ is on the stack of every call of its forward; it is
            # the API only when it called torch's checkpoint itself (remat.wrap was not seen first).
            library = next((lib for lib in _LIBRARIES if lib in path.split(os.sep)), None)
            if library is not None and api == "torch.utils.checkpoint.checkpoint":
                api = f"{_LIBRARIES[library]} gradient checkpointing"
            return f"{_short(path)}:{frame.f_lineno}", api
        frame = frame.f_back
    return "<unknown>", api
