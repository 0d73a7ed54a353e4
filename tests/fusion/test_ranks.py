"""``ranks.structure_inputs``: a tuple of sizes whose length the tensor arguments' ranks alone decide, and the
steps that make it depend on sizes or values instead; ``ranks.rank_inputs``: a rank, or arithmetic on ranks."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from opsnn_lab.fusion.ranks import rank_inputs, structure_inputs


class Sizes(nn.Module):
    """Returns ``shape_of(x, y)``: the node under test is the output's value."""

    def __init__(self, shape_of, leaf: nn.Module | None = None):
        super().__init__()
        self.shape_of, self.drop, self.fc = shape_of, nn.Dropout(0.1), nn.Linear(4, 4)
        self.leaf = leaf if leaf is not None else nn.Identity()

    def forward(self, x, y):
        return self.shape_of(self, x, y)


class UserLeaf(nn.Module):  # a module fx keeps as one call below: its forward may do anything
    def forward(self, x):
        return x


class KeepsUserLeaf(fx.Tracer):
    def is_leaf_module(self, m, name):
        return isinstance(m, UserLeaf) or super().is_leaf_module(m, name)


FACTS = {"x": {"ndim": 4, "is_nested": False}, "y": {"ndim": 2, "is_nested": False}}


def _inputs_of(shape_of, facts=FACTS, leaf=None, decided_by=structure_inputs):
    module = Sizes(shape_of, leaf)
    graph = KeepsUserLeaf().trace(module)
    value = next(n for n in graph.nodes if n.op == "output").args[0]
    return decided_by(value, facts, module)


def _attention_context(m, x, y):  # BERT-family attention: probabilities' dropout, then the heads merged back
    probs = m.drop(torch.softmax(x @ x.transpose(-1, -2), dim=-1))
    ctx = (probs @ m.fc(x)).permute(0, 2, 1, 3).contiguous()
    return ctx.size()[:-2] + (16,)


@pytest.mark.parametrize("shape_of, inputs", [
    (_attention_context, {"x"}),
    (lambda m, x, y: x.shape[:-1], {"x"}),
    (lambda m, x, y: (x + y).shape[1:] + y.shape, {"x", "y"}),  # a broadcast, two tuples joined
    (lambda m, x, y: F.dropout(x, 0.2).view(x.shape[:2] + (-1,)).size(), {"x"}),
    (lambda m, x, y: x.flatten(1).unsqueeze(0)[:, None, 0].shape * 2, {"x"}),  # constant flatten, indexing
    (lambda m, x, y: x.chunk(2, dim=-1)[0].shape, {"x"}),  # each piece has the input's rank
    (lambda m, x, y: m.leaf(x).shape, {"x"}),  # nn.Identity: torch.nn's own, rank kept
    (lambda m, x, y: m.fc.weight.shape + x.shape[:1], {"x"}),  # a parameter's rank is its own
])
def test_a_tuple_whose_length_ranks_decide_names_those_arguments(shape_of, inputs):
    assert _inputs_of(shape_of) == inputs


@pytest.mark.parametrize("shape_of", [
    lambda m, x, y: x.squeeze().shape,  # drops the dimensions of size 1
    lambda m, x, y: x.squeeze(1).shape,
    lambda m, x, y: x.flatten(y.shape[0]).shape,  # flattened from a traced dimension
    lambda m, x, y: x.shape[: y.shape[0]],  # sliced at a traced bound
    lambda m, x, y: x.shape * y.shape[0],  # repeated a traced number of times
    lambda m, x, y: x[y > 0].shape,  # a tensor index: its dtype decides the rank
    lambda m, x, y: m.leaf(x).shape,  # a user module kept as one call
    lambda m, x, y: x.shape[0],  # a size, not a tuple of sizes
    lambda m, x, y: x,  # a tensor
])
def test_sizes_values_and_unknown_modules_are_not_ranks(shape_of):
    leaf = UserLeaf()
    assert _inputs_of(shape_of, leaf=leaf) is None


def test_an_argument_without_a_known_rank_or_nested_decides_nothing():
    assert _inputs_of(lambda m, x, y: x.shape, facts={"y": FACTS["y"]}) is None
    assert _inputs_of(lambda m, x, y: x.shape, facts={"x": {"ndim": 4, "is_nested": True}}) is None


@pytest.mark.parametrize("rank_of, inputs", [
    (lambda m, x, y: (m.drop(m.fc(y)) + y).ndim == 4, {"y"}),  # diffusers' block: after the dropout, a rank
    (lambda m, x, y: x.dim() - 1, {"x"}),
    (lambda m, x, y: (x.ndim + y.ndimension()) > 2, {"x", "y"}),
    (lambda m, x, y: x[:, None].ndim, {"x"}),
])
def test_a_rank_and_arithmetic_on_ranks_name_the_arguments_that_decide_it(rank_of, inputs):
    assert _inputs_of(rank_of, decided_by=rank_inputs) == inputs
    assert _inputs_of(rank_of) is None  # not a tuple of sizes


@pytest.mark.parametrize("rank_of", [
    lambda m, x, y: x.squeeze(1).ndim,  # drops a dimension of size 1
    lambda m, x, y: x.ndim == y.shape[0],  # a size
    lambda m, x, y: x.ndim > x.numel(),
    lambda m, x, y: m.leaf(x).ndim,  # a user module kept as one call
    lambda m, x, y: x.shape,  # sizes, not a rank
])
def test_sizes_and_unknown_modules_do_not_decide_a_rank(rank_of):
    assert _inputs_of(rank_of, leaf=UserLeaf(), decided_by=rank_inputs) is None
