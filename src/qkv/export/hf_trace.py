"""An importer's weight mapping run backwards: qkv's weights under a Hugging Face class's own names.

Each importer (:mod:`qkv.importers`) says once how a family's tensors become qkv's: which tensor, which
rows, transposed, split or stacked (GPT-2's Conv1D transposes, BERT's query/key/value stacked into
``in_proj``, the vocabulary rows put in qkv's order, ALBERT's one layer group read by every layer, ...).
The export does not say it a second time. It hands the importer's ``state`` function a stand-in for
the folder's weights, :class:`Tagged`, whose every element holds its own address (1, 2, 3, ... over all
the tensors, as float64: exact to 2^53), and reads, in each tensor the importer returns, where each of
its elements came from. Writing each qkv element back to that address is the inverse:

    tagged = Tagged(shapes of the transformers model's parameters, config)
    traced = importer_state(tagged, ...)           # qkv name -> tensor of addresses (0: no source,
                                                   #   e.g. a qkv special row the model lacks)
    hf = invert(tagged, traced, checkpoint weights) # transformers name -> tensor

A family element that several qkv elements read (ALBERT's shared layers, a tied matrix) must hold
the same value in each (else the weights were changed apart and the family cannot hold them: refused
by name); an element no qkv element reads is reported, never invented. Only pure moves can be run
backwards: an importer that computes (T5 v1's output scale) cannot be exported this way.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qkv.errors import QkvError
from qkv.importers.folder import REQUIRED, Weights


class Tagged(Weights):
    """A stand-in for the folder's :class:`~qkv.importers.folder.Weights` whose tensors hold their elements'
    addresses; ``original`` names each tensor as the transformers model does (``renamed`` keeps it)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], config=None, _tensors=None, _names=None) -> None:
        if _tensors is None:
            _tensors, start = {}, 1
            for name, shape in shapes.items():
                n = 1
                for s in shape:
                    n *= s
                _tensors[name] = torch.arange(start, start + n, dtype=torch.float64).reshape(shape)
                start += n
            if start >= 2**53:
                raise QkvError("the model is too large to trace its weights' addresses exactly")
        super().__init__(_tensors, {}, config)
        self.original = _names or {k: k for k in _tensors}  # this stand-in's name -> the transformers model's

    def renamed(self, rename) -> "Tagged":
        tensors, names = {}, {}
        for k in self:
            tensors[rename(k)], names[rename(k)] = self[k], self.original[k]
        return Tagged({}, self.config, tensors, names)

    def take(self, name: str, shape=None, fields=(), default=REQUIRED) -> torch.Tensor:
        if name not in self:
            if default is not REQUIRED:
                return default
            raise QkvError(f"internal: the exported class has no tensor {name!r} that the importer reads")
        t = self[name]
        if shape is not None and (t.dim() != len(tuple(shape)) or
                                  any(s is not None and s != n for s, n in zip(shape, t.shape))):
            raise QkvError(f"internal: the exported class's {name!r} is {tuple(t.shape)}, the importer reads "
                           f"{tuple(shape)}")
        return t

    def check_layers(self, *args) -> None:  # the transformers model has the config's layers by construction
        pass

    def check_rows(self, *args) -> None:
        pass


def invert(tagged: Tagged, traced: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor],
           what: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The transformers tensors (by their own names) holding ``weights`` (qkv's, by name) at the addresses
    ``traced`` gives them; and the names of the tensors no qkv weight fills. ``what`` names the model in
    a refusal."""
    names = list(tagged)
    starts, flat = [], []
    for name in names:
        t = tagged[name]
        starts.append(int(t.reshape(-1)[0]) if t.numel() else 0)
        flat.append(torch.zeros(t.numel(), dtype=torch.float32))
    filled = [torch.zeros(t.numel(), dtype=torch.bool) for t in flat]
    order = sorted(range(len(names)), key=lambda i: starts[i])
    bounds = torch.tensor([starts[i] for i in order], dtype=torch.float64)
    for qname, addr in traced.items():
        if qname not in weights:
            raise QkvError(f"internal: the importer reads {qname!r}, which the checkpoint lacks")
        value = weights[qname].reshape(-1).float()
        addr = addr.reshape(-1)
        if addr.numel() != value.numel():
            raise QkvError(f"internal: {qname!r} has {value.numel()} values, the importer makes {addr.numel()}")
        real = addr >= 1
        addr, value = addr[real], value[real]
        if not torch.equal(addr, addr.round()):
            raise QkvError(f"internal: the importer computes {qname!r} from the folder's values (not a move): "
                           "it cannot be run backwards")
        which = torch.searchsorted(bounds, addr, right=True) - 1
        for j in which.unique().tolist():
            i = order[j]
            sel = which == j
            local = (addr[sel] - starts[i]).long()
            vals = value[sel]
            before = filled[i][local]
            if bool(before.any()) and not torch.equal(flat[i][local][before], vals[before]):
                raise QkvError(f"{what}: {tagged.original[names[i]]} is one tensor of the family's model, but the "
                               f"checkpoint's copies of it ({qname}, ...) differ: the class cannot hold these weights")
            flat[i][local] = vals
            filled[i][local] = True
    out, unfilled = {}, []
    for i, name in enumerate(names):
        if bool(filled[i].all()):
            out[tagged.original[name]] = flat[i].reshape(tagged[name].shape)
        elif bool(filled[i].any()):
            raise QkvError(f"internal: the checkpoint fills part of {tagged.original[name]} only")
        else:
            unfilled.append(tagged.original[name])
    return out, unfilled


__all__ = ["Tagged", "invert"]
