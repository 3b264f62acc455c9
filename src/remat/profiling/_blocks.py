"""Finding the checkpointing units ("blocks") of a model.

NOTE [Units]
A unit is a module the model calls, found from the top down: on each path the
top-most level whose callable children repeat (at least two non-leaf children of
the same class: transformer layers, ResNet stages and their bottlenecks, the seed
CNN's ``Sequential`` blocks), else the top-most level with two or more non-leaf
children in lists (a U-Net's unique down and up blocks, with the mid block beside
them). A ``ModuleList`` or ``ModuleDict`` is seen through (never called, never a
unit). In a ``Sequential`` the layers between its units are units too, so the run
of units stays a chain the nested planner can cut into segments. A model where no
level has either (a flat ``Sequential`` of Linear, GELU, ...; a ``ModuleList`` of
Linears) has the layers of its top-most chain or list as units, one layer each.
Checkpointing a lone layer alone saves nothing (its own backward keeps its input),
so the planner keeps it one level deep (NOTE [A lone layer is kept one level deep] in
``remat.planning._solve``), but in a run of layers it can sit inside a nested segment,
which is how a flat chain reaches the same floor as the chain written in blocks.

NOTE [Units beside repeated ones]
At a level whose children repeat, each other non-leaf child is searched for units of
its own. A level can hold a small repeated pair beside the stack where the memory is:
CaiT's top level has two class-attention blocks in a list beside its 24 layers in one
``Sequential``, timm's ByobNet models (MobileViT) a stem and a final conv of one class
beside their stages. The pair alone were the units (cait_xxs24: 2 units, none in its
trunk), so no plan could checkpoint the trunk.

NOTE [A block is refined into what it calls]
``"auto"`` refines fewer than eight units once, into the modules each calls itself (its
children, the items of its lists and of its plain ``Sequential`` chains) that hold units:
a ResNet stage's bottlenecks, a U-Net down block's resnets and attentions. Units found
deeper sit inside a callee whose own code runs between them, out of their reach: a Llama
layer with LoRA on every linear ("all-linear") was refined into its 7 ``lora.Linear``
wrappers, which leave the attention's scores and the MLP's activations outside every unit
(4 layers: 28 units, floor 0.639 of the peak; refined into attention and MLP, 0.33). Where
the callees holding units are one module (a stage of one block), that module is refined
the same way: else the stage would stay whole, and a stage of one HGNet block reached a
floor of 0.808 of the peak where its block's layers reach 0.749.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from torch import nn

from remat.errors import RematError

#: Coarse levels with fewer blocks than this are refined one level when possible.
_MIN_AUTO_BLOCKS = 8


def is_leaf(module: nn.Module) -> bool:
    return next(module.children(), None) is None


def _is_list(module: nn.Module) -> bool:
    """A container its parent loops over or indexes: never called itself, so never a unit."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def _callable_children(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module, bool]]:
    """(name, child, listed) for the children ``module`` can call, ``ModuleList``/``ModuleDict`` children seen
    through (their items, ``listed``: one of a list, as are a ``Sequential``'s children)."""
    found: list[tuple[str, nn.Module, bool]] = []
    for name, child in module.named_children():
        if _is_list(child):
            found.extend((n, c, True) for n, c, _ in _callable_children(child, f"{prefix}{name}."))
        else:
            found.append((f"{prefix}{name}", child, isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict))))
    return found


def _repeated_children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units at this level (NOTE [Units]): repeated non-leaf children (with every non-leaf child of a
    chain), else two or more non-leaf children of lists (a U-Net's unique stages) with their siblings."""
    children = _callable_children(module)
    inner = [(n, c, listed) for n, c, listed in children if not is_leaf(c)]
    counts = Counter(type(c) for _, c, _ in inner)
    if any(k >= 2 for k in counts.values()):
        picked = {n for n, c, listed in inner if counts[type(c)] >= 2 or listed}
    elif sum(listed for _, _, listed in inner) >= 2:
        picked = {n for n, _, _ in inner}
    else:
        return []
    names = [n for n, _, _ in children]
    if isinstance(module, nn.Sequential):  # a chain: the layers between its units are units too
        first, last = min(names.index(n) for n in picked), max(names.index(n) for n in picked)
        picked |= set(names[first : last + 1])
    return [(n, c) for n, c, _ in children if n in picked]


def _level(module: nn.Module, prefix: str) -> list[str]:
    """Blocks under ``module``: the top-most repeated children found on each path (NOTE [Units beside repeated
    ones])."""
    repeated = _repeated_children(module)
    if not repeated:
        found: list[str] = []
        for name, child in module.named_children():
            found.extend(_level(child, f"{prefix}{name}."))
        return found
    picked = {n for n, _ in repeated}
    found = []
    for name, child, _ in _callable_children(module):
        if name in picked:
            found.append(f"{prefix}{name}")
        elif not is_leaf(child):
            found.extend(_level(child, f"{prefix}{name}."))
    return found


def _flat(module: nn.Module, prefix: str) -> list[str]:
    """Units of a model with no repeated blocks: the layers of the top-most chain or list of two or more
    (a flat ``Sequential`` of Linear, GELU, ...; a ``ModuleList`` of Linears)."""
    children = _callable_children(module)
    if len(children) >= 2 and all(listed for _, _, listed in children):
        return [f"{prefix}{n}" for n, _, _ in children]
    for name, child in module.named_children():
        found = _flat(child, f"{prefix}{name}.")
        if found:
            return found
    return []


def _refine(model: nn.Module, names: list[str]) -> list[str]:
    modules = dict(model.named_modules())
    refined: list[str] = []
    for name in names:
        inner = _refined(modules, name)
        refined.extend(inner if _holds_all_parameters(modules[name], [modules[n] for n in inner]) else [name])
    return refined


def _refined(modules: dict[str, nn.Module], name: str) -> list[str]:
    """The units ``name`` is refined into: the modules it calls that hold units; where that is one module, what
    that one calls (NOTE [A block is refined into what it calls])."""
    block = modules[name]
    inner = _callees(block, name, _level(block, f"{name}."))
    if len(inner) == 1 and inner[0] != name:
        deeper = _refined(modules, inner[0])
        if _holds_all_parameters(modules[inner[0]], [modules[n] for n in deeper]):
            return deeper
    return inner


def _callees(block: nn.Module, name: str, inner: list[str]) -> list[str]:
    """For each of ``inner``, the module ``block`` calls that holds it, once each, in order (NOTE [A block is
    refined into what it calls])."""
    called = sorted(_called(block, name), key=len, reverse=True)
    found: list[str] = []
    for unit in inner:
        callee = next(c for c in called if unit == c or unit.startswith(f"{c}."))
        if callee not in found:
            found.append(callee)
    return found


def _called(module: nn.Module, name: str) -> Iterable[str]:
    """The modules ``module`` calls with no code of another module between: its children, seen through lists
    and through plain ``Sequential`` chains."""
    for child_name, child, _ in _callable_children(module, f"{name}."):
        yield child_name
        if type(child).forward is nn.Sequential.forward:
            yield from _called(child, child_name)


def _holds_all_parameters(block: nn.Module, inner: list[nn.Module]) -> bool:
    """Whether ``inner`` holds every parameter of ``block``'s non-leaf children: only then is refining it a
    finer cut of the same work (a stack's own leaves, its embedding and final norm, stay outside). A decoder
    layer of a mixture of experts holds a list of expert MLPs that its router calls per token; refining into
    those would leave the attention outside every block."""
    held = {id(p) for module in inner for p in module.parameters()}
    return bool(inner) and all(
        id(p) in held for child in block.children() if not is_leaf(child) for p in child.parameters()
    )


def find_blocks(model: nn.Module, blocks: str | Sequence[str] | None = None) -> list[str]:
    """Qualified names of the blocks, in registration order.

    ``blocks``: None or ``"auto"`` (coarse, refined once while fewer than 8),
    ``"coarse"``, ``"fine"`` (refined until no repeated children remain), or
    an explicit list of module names.
    """
    modules = dict(model.named_modules())
    if blocks is not None and not isinstance(blocks, str):
        names = list(blocks)
        unknown = [n for n in names if n not in modules]
        if unknown:
            raise RematError(
                f"remat.profile: blocks {unknown} are not modules of {type(model).__name__}; "
                f"pass names from model.named_modules(), e.g. {list(modules)[1:4]}."
            )
        check_disjoint(names, api="remat.profile:")
        check_block_modules(model, names, api="remat.profile")
        return names
    mode = blocks or "auto"
    if mode not in ("auto", "coarse", "fine"):
        raise RematError(f"remat.profile: blocks={mode!r}; use 'auto', 'coarse', 'fine' or a list of module names.")
    names = _level(model, "") or _flat(model, "")
    if mode == "coarse":
        return names
    while True:
        if mode == "auto" and len(names) >= _MIN_AUTO_BLOCKS:
            return names
        refined = _refine(model, names)
        if refined == names:
            return names
        names = refined
        if mode == "auto":
            return names


def check_disjoint(names: list[str], *, api: str) -> None:
    """A RematError when one block is inside another (``api`` starts the message)."""
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise RematError(
                    f"{api} block {b!r} is inside block {a!r}; blocks must not nest. "
                    "Name either the outer module or the inner ones."
                )


#: torch layers that run one op: their own backward keeps what checkpointing them would keep.
_SINGLE_OP_LAYERS = tuple(
    f"torch.nn.modules.{m}"
    for m in ("linear", "conv", "activation", "dropout", "normalization", "batchnorm", "sparse", "flatten", "pooling")
)


def is_single_op_layer(module: nn.Module | None) -> bool:
    """A lone single-op torch layer (a Linear, a LayerNorm, a ReLU): ``remat.apply`` checkpoints it only inside a
    nested segment, and the planner keeps it one level deep (NOTE [A lone layer is kept one level deep])."""
    return module is not None and is_leaf(module) and type(module).__module__ in _SINGLE_OP_LAYERS


def check_block_modules(model: nn.Module, names: Iterable[str], *, api: str) -> None:
    """A RematError when a block is a lone single-op torch layer (a Linear, a ReLU): checkpointing it saves nothing."""
    modules = dict(model.named_modules())
    for name in names:
        module = modules.get(name)
        if is_single_op_layer(module):
            parent = name.rpartition(".")[0]
            raise RematError(
                f"{api}: block {name!r} is a lone {type(module).__name__}, a single-op torch layer: its own backward "
                "keeps what checkpointing it would keep, so it saves nothing. Name the module that contains it"
                f"{f' ({parent!r})' if parent else ''} or a group of layers instead."
            )


def _lone_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Non-leaf modules alone in a ModuleList / Sequential: how a model that shares one layer
    across depth (ALBERT) holds it; its forward calls that layer once per depth."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        children = list(module.named_children())
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) == 1 and not is_leaf(children[0][1]):
            if not any(name.startswith(f"{outer}.") for outer, _ in found):
                found.append((f"{name}.{children[0][0]}" if name else children[0][0], children[0][1]))
    return found


def suggest_blocks(model: nn.Module) -> str:
    """A hint for a model with no repeated children: its shared layer, else its largest submodules."""
    lone = _lone_layers(model)
    if lone:
        name, layer = lone[0]
        return (
            f"; {name!r} ({type(layer).__name__}) is the only layer in its list, the shape of a layer "
            f"shared across depth (ALBERT): blocks=[{name!r}] checkpoints it, each call recomputed in backward"
        )
    sizes = sorted(
        ((sum(p.numel() for p in m.parameters()), n) for n, m in model.named_modules() if n and not is_leaf(m)),
        reverse=True,
    )
    return f", e.g. {[n for _, n in sizes[:3]]}" if sizes else ""
