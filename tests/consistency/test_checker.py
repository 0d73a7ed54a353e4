"""ConsistencyChecker: the first divergence is the perturbed module and op, forward and backward."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab.consistency import ConsistencyChecker, ConsistencyReport
from opsnn_lab.models import EncoderConfig, MaskedTokenTask

TASK = MaskedTokenTask(batch_size=2, seq_len=8, fused_head=False)  # the head runs as a module: "head" is named


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return TASK.model(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))


def traced_step(checker: ConsistencyChecker, model: nn.Module) -> ConsistencyReport:
    model.zero_grad(set_to_none=True)
    with checker.trace(model):
        loss = TASK.loss(model, TASK.batch(0))
        loss.backward()
    return checker.report


def perturb(model: nn.Module, name: str, eps: float = 1e-4) -> None:
    w = model.get_parameter(f"{name}.weight")
    with torch.no_grad():
        w.add_(eps * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))


class _Noise(torch.autograd.Function):
    """Adds fresh random noise in forward and in backward: a non-deterministic op."""

    @staticmethod
    def forward(ctx, x):
        return x + 1e-3 * torch.randn_like(x)

    @staticmethod
    def backward(ctx, g):
        return g + 1e-3 * torch.randn_like(g)


class NoisyGELU(nn.GELU):
    def forward(self, x):
        return _Noise.apply(super().forward(x))



def test_first_trace_is_reference_and_unperturbed_rerun_is_exact():
    model, checker = make_model(), ConsistencyChecker(dump_on_failure=False)
    first = traced_step(checker, model)
    assert first.reference_only and first.ok and checker.reference is not None
    report = traced_step(checker, model)
    assert report.ok and report.first_divergence is None
    assert report.max_abs_err == 0.0
    assert all(r.exact and r.max_abs_err == 0.0 and r.cosine == 1.0 for r in report.rows)
    phases = {r.phase for r in report.rows}
    assert phases == {"forward", "backward"}
    # every parameter's gradient is compared too
    grads = [r for r in report.rows if r.kind == "grad"]
    assert len(grads) == len(list(model.parameters()))


@pytest.mark.parametrize("name", ["layers.0.mlp.fc1", "layers.1.attention.value", "head"])
def test_weight_perturbation_is_named_forward_and_backward(name):
    model, checker = make_model(), ConsistencyChecker(dump_on_failure=False)
    traced_step(checker, model)
    perturb(model, name)
    report = traced_step(checker, model)
    assert not report.ok
    fwd, bwd = report.forward_divergence, report.backward_divergence
    assert (fwd.module_path, fwd.op, fwd.phase, fwd.origin) == (name, "aten.addmm", "forward", "input")
    assert (bwd.module_path, bwd.op, bwd.phase, bwd.origin) == (name, "aten.mm", "backward", "input")
    assert report.first_divergence is fwd
    # the source line is the user's call of that Linear in models.py, not a line inside torch
    assert fwd.location.rsplit(":", 1)[0].endswith("opsnn_lab/models.py")
    assert 0 < fwd.max_abs_err < 1e-2 and fwd.max_rel_err > 0 and 0.99 < fwd.cosine < 1.0
    assert fwd.output_stats["reference"][0]["hash"] != fwd.output_stats["run"][0]["hash"]
    # the weight is the input that differs: its stats come from both runs
    ref_in, run_in = fwd.input_stats["reference"], fwd.input_stats["run"]
    assert len(ref_in) == len(run_in) == 3
    assert [a["hash"] == b["hash"] for a, b in zip(ref_in, run_in)] == [True, True, False]


def test_a_compared_trace_has_the_statistics_of_its_own_tensors():
    # a compared trace hashes first and takes the reference's statistics where the bits are the same; its
    # statistics must be the ones a first (fully summarised) trace of the same step gets, changed or not
    model, checker = make_model(), ConsistencyChecker(dump_on_failure=False)
    traced_step(checker, model)
    perturb(model, "layers.1.mlp.fc2", eps=0.1)  # large enough to move every later statistic clearly
    report = traced_step(checker, model)
    alone = ConsistencyChecker(dump_on_failure=False)
    traced_step(alone, model)  # the same step again, as a reference: everything summarised in full
    run, ref, full = checker.last_trace, checker.reference.by_key(), alone.reference.by_key()
    same = changed = 0
    for rec in run.records:
        assert rec.output_stats == full[rec.key].output_stats, (rec.op, rec.module_path)
        assert rec.input_stats == full[rec.key].input_stats, (rec.op, rec.module_path)
        theirs = ref[rec.key].output_stats
        same += all(a.hash == b.hash for a, b in zip(rec.output_stats, theirs))
        changed += any(a.mean != b.mean for a, b in zip(rec.output_stats, theirs))
    assert same > 0 and changed > 0 and report.first_divergence.module_path == "layers.1.mlp.fc2"


def test_planted_nondeterministic_op_is_named_forward_and_backward():
    model, checker = make_model(), ConsistencyChecker(dump_on_failure=False)
    model.layers[1].mlp.act = NoisyGELU()
    traced_step(checker, model)
    report = traced_step(checker, model)
    fwd, bwd = report.forward_divergence, report.backward_divergence
    assert (fwd.module_path, fwd.op, fwd.origin) == ("layers.1.mlp.act", "aten.randn_like", "op")
    assert (bwd.module_path, bwd.op, bwd.origin) == ("layers.1.mlp.act", "aten.randn_like", "op")
    line = inspect.getsourcelines(_Noise.forward)[1] + 2
    assert fwd.location.endswith(f"test_checker.py:{line}")
    # everything before the noisy layer agrees bit for bit
    before = [r for r in report.rows if r.phase == "forward" and r.index < fwd.index]
    assert before and all(r.exact for r in before)


def build_layernorm_trap(model: nn.Module) -> nn.LayerNorm:
    """Make ``layers.0.attn_norm`` a LayerNorm whose output mean is zero but moves with its input.

    Its weight varies per feature, so the mean of ``weight * x_hat`` depends on the input, and its bias
    cancels that mean for the unperturbed batch: the reference mean is rounding noise (~1e-9, or 0) while a
    perturbed Linear upstream moves it by ~1e-6. Every other LayerNorm gets a bias of 0.5, so no other op
    has a near-zero mean whichever SIMD kernels this CPU runs.
    """
    trap = model.get_submodule("layers.0.attn_norm")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm) and m is not trap:
                m.bias.fill_(0.5)
        trap.weight.copy_(1 + torch.rand(trap.weight.shape, generator=g))
        trap.bias.zero_()
        seen = []
        handle = trap.register_forward_hook(lambda mod, args, out: seen.append(out.double().mean()))
        TASK.loss(model, TASK.batch(0))
        handle.remove()
        trap.bias.fill_(-seen[0].item())
    return trap


def test_layernorm_trap_names_the_linear_not_the_layernorm():
    """A relative-statistics comparison names a LayerNorm (mean ~ 0); elementwise errors name the Linear."""
    model, checker = make_model(), ConsistencyChecker(dump_on_failure=False)
    build_layernorm_trap(model)
    traced_step(checker, model)
    perturb(model, "layers.0.attention.output")
    report = traced_step(checker, model)

    def rel_mean_err(row):
        a, b = row.run_stats[0]["mean"], row.ref_stats[0]["mean"]
        return abs(a - b) / max(abs(b), 1e-30)

    ops = [r for r in report.rows if r.phase == "forward" and r.kind == "op"]
    naive = max(ops, key=rel_mean_err)
    # the trap exists by construction: a naive comparison blames the LayerNorm by orders of magnitude
    assert (naive.module_path, naive.op) == ("layers.0.attn_norm", "aten.native_layer_norm.default")
    assert abs(naive.ref_stats[0]["mean"]) < 1e-7 and rel_mean_err(naive) > 10
    assert all(rel_mean_err(r) < 0.1 for r in ops if r is not naive)
    fwd = report.first_divergence
    assert (fwd.module_path, fwd.op) == ("layers.0.attention.output", "aten.addmm")
    assert fwd.index < naive.index


def test_check_gradients_false_records_forward_only():
    model, checker = make_model(), ConsistencyChecker(check_gradients=False, dump_on_failure=False)
    traced_step(checker, model)
    perturb(model, "layers.0.mlp.fc2")
    report = traced_step(checker, model)
    assert {r.phase for r in report.rows} == {"forward"}
    assert report.backward_divergence is None and report.forward_divergence.module_path == "layers.0.mlp.fc2"


def test_precision_none_uses_the_dtype_default():
    model, checker = make_model(), ConsistencyChecker(precision=None, dump_on_failure=False)
    traced_step(checker, model)
    perturb(model, "layers.0.mlp.fc1", eps=1e-9)   # far below fp32's default tolerance
    report = traced_step(checker, model)
    assert report.ok and not all(r.exact for r in report.rows)
    assert {(r.atol, r.rtol) for r in report.rows if r.op == "aten.addmm.default"} == {(1e-6, 1e-5)}
    strict = ConsistencyChecker(precision=1e-12, dump_on_failure=False)
    traced_step(strict, model)
    perturb(model, "layers.0.mlp.fc1", eps=1e-7)
    assert not traced_step(strict, model).ok


def test_reference_saved_to_file_is_compared_in_a_new_checker(tmp_path):
    model = make_model()
    first = ConsistencyChecker(dump_on_failure=False)
    traced_step(first, model)
    path = tmp_path / "ref.pt"
    first.save_reference(path)
    hashes_only = tmp_path / "ref_hashes.pt"
    first.save_reference(hashes_only, tensors=False)
    other = ConsistencyChecker(dump_on_failure=False)
    other.load_reference(path)
    assert traced_step(other, model).ok
    perturb(model, "layers.1.mlp.fc2")
    report = traced_step(other, model)
    assert report.first_divergence.module_path == "layers.1.mlp.fc2"
    assert report.first_divergence.max_abs_err > 0
    light = ConsistencyChecker(dump_on_failure=False)
    light.load_reference(hashes_only)
    report = traced_step(light, model)
    assert report.first_divergence.module_path == "layers.1.mlp.fc2"
    assert report.rows[report.first_divergence.index].measured == "hash"


def test_reference_copies_its_leaves_and_a_compared_trace_holds_them_until_they_change(tmp_path):
    model, checker = make_model(), ConsistencyChecker(dump_on_failure=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = model.get_parameter("layers.0.mlp.fc1.weight")
    traced_step(checker, model)
    ref_grad = checker.reference.records[-1].outputs[0]  # the last parameter's .grad at the reference step
    before = (w.detach().clone(), ref_grad.clone())
    opt.step()
    # the reference kept the step's values: the optimizer and the next zero_grad change the live ones
    leaf = next(a for r in checker.reference.records for a in r.input_tensors() if a.shape == w.shape
                and r.module_path == "layers.0.mlp.fc1")
    assert torch.equal(leaf, before[0]) and not torch.equal(leaf, w.detach())
    assert torch.equal(checker.reference.records[-1].outputs[0], before[1])

    assert not traced_step(checker, model).ok  # the weights moved: a divergence, found at once
    run = checker.last_trace
    grad = next(r.outputs[0] for r in run.records if r.kind == "grad" and r.module_path == "layers.0.mlp.fc1"
                and r.op == "grad.weight")
    assert grad.untyped_storage().data_ptr() == w.grad.untyped_storage().data_ptr()  # held, not copied
    run.save(tmp_path / "fresh.pt")  # unchanged yet: its tensors are the step's
    opt.step()
    assert run.changed_since_recorded() > 0
    with pytest.raises(ValueError, match="tensors=True"):
        run.save(tmp_path / "stale.pt")
    with pytest.raises(ValueError, match="trace:"):
        checker.check(run)
    run.save(tmp_path / "stats.pt", tensors=False)  # statistics and hashes were taken at the step's end
    assert [r.output_stats for r in type(run).load(tmp_path / "stats.pt").records] == \
        [r.output_stats for r in run.records]


class _MLP(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fused = fused
        if fused:
            self.fc1_act = _LinearGELU(16, 32)
        else:
            self.fc1, self.act = nn.Linear(16, 32), nn.GELU()
        self.fc2 = nn.Linear(32, 16)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)

    def forward(self, x):
        h = self.fc1_act(x) if self.fused else self.act(self.fc1(x))
        return self.fc2(h)


class _LinearGELU(nn.Module):
    """Linear + GELU as one module, written as matmul + add (a different op sequence than addmm)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x):
        return F.gelu(torch.matmul(x, self.weight.t()) + self.bias)


class _Block(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.mlp = _MLP(fused)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x + self.mlp(x))


def test_compare_aligns_a_fused_module_with_the_chain_it_replaced():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    a, b = _Block(False), _Block(True)
    checker = ConsistencyChecker(precision=1e-5, dump_on_failure=False)
    report = checker.compare(lambda: a(x).square().sum().backward(), lambda: b(x).square().sum().backward())
    assert report.ok, report
    assert {"mlp.fc1", "mlp.fc1_act"} <= set(report.unaligned)
    # the module boundary "mlp" is compared even though its inside differs
    mlp_rows = [r for r in report.rows if r.kind == "module" and r.module_path == "mlp"]
    assert len(mlp_rows) == 1 and mlp_rows[0].max_abs_err < 1e-5
    with torch.no_grad():
        b.mlp.fc1_act.weight[0, 0] += 1e-3
    report = checker.compare(lambda: a(x).square().sum().backward(), lambda: b(x).square().sum().backward())
    assert not report.ok
    first = report.first_divergence
    # the first aligned op after the fused module, flagged as fed by a module without a counterpart
    assert (first.module_path, first.op, first.origin) == ("mlp.fc2", "aten.addmm", "unaligned")


def test_compare_restores_the_random_state_for_both_variants():
    drop = nn.Dropout(0.5)
    x = torch.ones(64)
    report = ConsistencyChecker(dump_on_failure=False).compare(lambda: drop(x), lambda: drop(x))
    assert report.ok and all(r.exact for r in report.rows)


@pytest.mark.parametrize("kwargs, exc, word", [
    ({"precision": -1.0}, ValueError, "precision"),
    ({"precision": "1e-6"}, TypeError, "precision"),
    ({"check_gradients": "yes"}, TypeError, "check_gradients"),
    ({"dump_on_failure": 1}, TypeError, "dump_on_failure"),
    ({"dump_dir": 3}, TypeError, "dump_dir"),
])
def test_bad_arguments_name_the_argument(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        ConsistencyChecker(**kwargs)


def test_bad_call_arguments():
    checker = ConsistencyChecker()
    with pytest.raises(TypeError, match="fn_a"):
        checker.compare(3, lambda: None)
    with pytest.raises(TypeError, match="model"):
        with checker.trace("model"):
            pass
    with pytest.raises(ValueError, match="reference"):
        checker.save_reference("never_written.pt")


def test_fp32_against_bf16_uses_the_looser_default_tolerance():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    b = copy.deepcopy(a).to(torch.bfloat16)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    checker = ConsistencyChecker(precision=None, dump_on_failure=False)
    report = checker.compare(lambda: a(x).sum().backward(), lambda: b(x.bfloat16()).float().sum().backward())
    rows = [r for r in report.rows if r.module_path == "0" and r.kind == "op" and r.phase == "forward"]
    assert rows and {(r.atol, r.rtol) for r in rows} == {(1e-2, 1.6e-2)}
    assert all(0 < r.max_abs_err < 0.05 for r in rows)
    # 1e-6 is meaningless for bf16: the same comparison at a fixed precision diverges at once
    strict = ConsistencyChecker(precision=1e-6, dump_on_failure=False)
    assert not strict.compare(lambda: a(x).sum().backward(), lambda: b(x.bfloat16()).float().sum().backward()).ok


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compare_cpu_against_gpu_aligns_every_op():
    torch.manual_seed(0)
    cpu = TASK.model(EncoderConfig.tiny(dropout=0.0, attn_dropout=0.0))
    gpu = copy.deepcopy(cpu).cuda()
    batch = TASK.batch(0)
    gbatch = {k: v.cuda() for k, v in batch.items()}
    report = ConsistencyChecker(precision=1e-4, dump_on_failure=False).compare(
        lambda: TASK.loss(cpu, batch).backward(), lambda: TASK.loss(gpu, gbatch).backward())
    assert report.ok, report
    assert {r.phase for r in report.rows} == {"forward", "backward"}
    assert report.max_abs_err < 1e-4 and any(not r.exact for r in report.rows)


@pytest.mark.parametrize("memory_limit", [None, 0])
def test_a_buffer_updated_in_place_is_the_step_s_value_and_a_restored_one_repeats(memory_limit):
    # BatchNorm's num_batches_tracked.add_ returns the buffer itself: the reference held it by reference and
    # compared the next step's value with itself (a changed state went unseen) unless the limit summarised it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(16, 4)
    checker = ConsistencyChecker(dump_on_failure=False, memory_limit=memory_limit)
    state = copy.deepcopy(model.state_dict())

    def step():
        model.zero_grad(set_to_none=True)
        with checker.trace(model):
            model(x).sum().backward()
        return checker.report

    step()
    report = step()  # the running statistics and the counter moved on: not the same step
    fwd = report.forward_divergence
    assert (fwd.module_path, fwd.op, fwd.origin) == ("1", "aten.add_", "input")
    model.load_state_dict(state)
    step()
    assert checker.report.ok and checker.report.first_divergence is None  # from the same state: op for op
