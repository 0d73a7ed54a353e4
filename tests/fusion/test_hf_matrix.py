"""The model matrix: Hugging Face models built from tiny configs (no downloads) plus the embedded encoder and
CNN. For each model, in train mode (dropout 0) and in eval mode: analysis and apply do not raise, outputs and
every parameter gradient match eager, state_dict keys are identical, and the candidates per pattern are the
ones the architecture has. Activation bytes fused/eager are recorded (``record_property``)."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

import opsnn_lab as ol
from opsnn_lab.bench import activation_bytes
from opsnn_lab.demos import zoo
from opsnn_lab.fusion.runtime import flatten_tensors
from opsnn_lab.testing import assert_within_eager_error

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

# Candidates per pattern (fused + rejected) the architecture has at 2 layers / 2 stages.
CANDIDATES = {
    "bert": {"linear_gelu_linear": 2, "linear_gelu": 1, "qkv": 2,  # + the MLM head's transform
             "add_layer_norm": 5, "layer_norm": 6, "linear_cross_entropy": 1},
    "roberta": {"linear_gelu_linear": 2, "qkv": 2, "add_layer_norm": 5, "layer_norm": 5},
    "gpt2": {"linear_gelu_tanh_linear": 2,  # c_attn is one Conv1D already: no QKV triple
             "add_layer_norm": 4, "layer_norm": 5, "linear_cross_entropy": 1},
    # the fallbacks of a fused gated MLP (linear_<act>, gated_product) are candidates it overlaps
    "llama": {"gated_mlp_silu": 2, "linear_silu": 2, "gated_product_silu": 2,
              "qkv": 2,  # GQA: k/v narrower than q
              "add_rms_norm": 4, "rms_norm": 5, "linear_cross_entropy": 1},
    # eager attention whose scores are capped by 50 tanh(s / 50) (since 2026-12-07: FusedAttention(softcap=50)); four
    # RMSNorms a layer, two of them after a residual add
    "gemma2": {"gated_mlp_gelu_tanh": 2, "linear_gelu_tanh": 2, "gated_product_gelu_tanh": 2, "attention": 2,
               "qkv": 2, "add_rms_norm": 4, "rms_norm": 9, "linear_cross_entropy": 1},
    # the experts run transformers' grouped-GEMM forward (traced: wrappers.handed_to); a gated product each layer
    "mixtral": {"gated_product_silu": 2, "qkv": 2, "add_rms_norm": 4, "rms_norm": 5, "linear_cross_entropy": 1},
    "phi3": {"gated_mlp_silu": 2,  # gate_up_proj: one Linear split by chunk; qkv_proj is one GEMM already
             "gated_product_silu": 2,
             "add_rms_norm": 4, "rms_norm": 5, "linear_cross_entropy": 1},
    "falcon": {"linear_gelu_linear": 2,  # dense_h_to_4h / dense_4h_to_h are FalconLinear (x @ W.T + b)
               "add_layer_norm": 2, "layer_norm": 3, "linear_cross_entropy": 1},
    "bloom": {"linear_gelu_tanh_linear": 2,  # BloomGelu: tanh-GELU written out, named by its probe
              "add_layer_norm": 4, "layer_norm": 6, "linear_cross_entropy": 1},
    "t5": {"gated_mlp_gelu_tanh": 4, "linear_gelu_tanh": 4, "gated_product_gelu_tanh": 4,
           "qkv": 6,  # cross-attention k/v read the encoder
           "add_rms_norm": 10, "rms_norm": 12, "linear_cross_entropy": 1},
    "resnet": {"conv_bn_relu_maxpool": 1, "conv_bn_relu": 5},
    # its squeeze-excitations (conv -> SiLU -> conv on pooled 1 x 1 maps) are candidates, declined as not worth it
    "efficientnet": {"conv_bn_silu": 15, "conv_bn_relu": 7, "conv_silu_conv": 7},
    "mobilenet_v2": {"conv_bn_relu6": 35, "conv_bn_relu": 17},
    # + the stem's and the downsampling layer's channels-first LayerNorms (since 2026-12-07), and the residual add
    # before the latter, declined (the op would return the residual stream in another layout)
    "convnext": {"linear_gelu_linear": 2, "layer_norm": 5, "add_layer_norm": 1},
    "encoder": {"linear_gelu_dropout_linear": 2, "attention": 2, "qkv": 2, "add_layer_norm": 5, "layer_norm": 5},
    "cnn": {"conv_bn_relu_maxpool": 1, "conv_bn_relu": 5},
}
# A candidate may stay unfused only for these reasons: the fused op's own answer (its activation or layer
# type is not one it computes yet), a structure that is not the chain (BN output into an add / a conv, an
# add that broadcasts, q/k/v of different tensors), a larger fused chain holding it, a residual add inline
# in a forward no rewrite can reach, or logits the model returns (the documented recipe is named).
ALLOWED = re.compile(r"^Fused\w+: |not a ReLU or another activation|goes to `|overlaps the fused (gated_mlp|add_)|"
                     r"broadcasts|read different tensors|lm_head_loss|over the channels of an \(N, C, \*\) input|"
                     r"^cannot be rewritten: `[\w.]+add(#\d+)?` runs inline|"
                     r"^not fused: saves \d[\d,]* of its [\d,]+ activation bytes here \(under (10%\); FusedLayerNorm|"
                     r"25%\); the fused op drops the activation's output)")


def _call(model, inputs):
    return model(*inputs) if isinstance(inputs, tuple) else model(**inputs)


def _step(model, inputs):
    out = _call(model, inputs)
    tensors = [t for t in flatten_tensors(out) if t.is_floating_point()]
    loss = sum((t.double() * (i + 1)).sin().sum() for i, t in enumerate(tensors))
    model.zero_grad(set_to_none=True)
    loss.backward()
    return tensors, {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _close(eager, fused) -> bool:
    """fp32: rtol 1e-4; atol 1e-5 of the tensor's scale (sums over a batch reassociate)."""
    atol = 1e-5 * max(1.0, eager.abs().max().item())
    return torch.allclose(fused, eager, rtol=1e-4, atol=atol)


def _reproducible_steps(models, inputs, weight: str, seed: int = 7) -> list:
    """Per model: ``make_reproducible(model, seed)``, one forward and backward of the mean square of the logits;
    (logits, the gradient of the parameter named ``weight``)."""
    outs = []
    for m in models:
        ol.consistency.make_reproducible(m, seed)
        m.zero_grad(set_to_none=True)
        out = m(**inputs).logits
        out.square().mean().backward()
        outs.append((out.detach(), m.get_parameter(weight).grad))
    return outs


def _nearer_the_truth_than_twice_eager(model, inputs, mode, pairs):
    """Where fused and eager differ past that, each is judged against an fp64 run: a network with ill-conditioned
    layers (BatchNorm over 2 values per channel, deep in a tiny MobileNetV2) turns 1e-7 differences upstream
    into 1e-4 at its output, and eager's own error against fp64 is as large there."""
    model = model.double().train(mode == "train")
    cast = lambda v: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
    inputs = tuple(map(cast, inputs)) if isinstance(inputs, tuple) else {k: cast(v) for k, v in inputs.items()}
    torch.manual_seed(0)
    outs, grads = _step(model, inputs)
    truth = {f"output {i}": t for i, t in enumerate(outs)} | grads
    for key, eager, fused in pairs:
        assert_within_eager_error(fused, eager, truth[key], factor=2.0, floor=_noise_floor(key, eager, truth),
                                  name=key)


# Ulps of its module's largest gradient that a cancellation-noise gradient may carry; eager and fused reach 5.
NOISE_ULPS = 16


def _noise_floor(key, eager, truth) -> float | None:
    """A gradient that eager gets with no correct digit (its error exceeds the fp64 value) is cancellation
    noise: a bias whose output reaches a train-mode BatchNorm through a linear layer, or a key bias under
    softmax, has gradient 0 by symmetry, and fp32 leaves a few ulps of the terms that cancel. Those terms are
    the size of the module's other gradients, so the noise is judged against NOISE_ULPS of that scale; two
    noise draws are not ordered by a factor 2. Any other tensor keeps the default floor."""
    ref = truth[key]
    if ref.numel() == 0 or (eager.double() - ref).abs().max().item() < ref.abs().max().item():
        return None
    module = key.rpartition(".")[0]
    scale = max(g.abs().max().item() for k, g in truth.items()
                if g is not None and k.rpartition(".")[0] == module and g.numel())
    return NOISE_ULPS * torch.finfo(eager.dtype).eps * scale


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_matrix(name, record_property):
    model, inputs = zoo.build(name, dropout=0.0)
    plan = ol.fusion.analyze(model, inputs)
    fused = ol.fusion.apply(model, plan)
    assert list(fused.state_dict()) == list(model.state_dict())
    counts = {p: row["fused"] + row["rejected"] for p, row in plan.summary().items()}
    assert counts == CANDIDATES[name]
    assert plan.not_analysed == {}  # every module holding parameters ran in the recorded forward
    for d in plan.decisions:
        assert d.fused or ALLOWED.search(d.reason), (d.pattern, d.modules, d.reason)
        # the MLPs (gated or not) and the RMSNorms fuse on every model (a norm alone or with its residual add)
        if d.pattern.startswith("gated_mlp") or d.pattern == "linear_gelu_tanh_linear" or (
                d.pattern == "rms_norm" and not d.reason.startswith("overlaps the fused add_rms_norm")):
            assert d.fused, (d.pattern, d.modules, d.reason)
        assert "torch.fx" not in d.reason  # rejections speak about the computation
    for mode in ("train", "eval"):
        model.train(mode == "train")
        fused.train(mode == "train")
        if mode == "eval":
            # the training step updated each model's running statistics from its own batch statistics: equal
            # to fp32 rounding; eval then starts both from eager's, so it compares the eval computation alone
            buffers = dict(model.named_buffers())
            for key, buf in fused.named_buffers():
                torch.testing.assert_close(buf, buffers[key], msg=key)
            fused.load_state_dict(model.state_dict())
        before = copy.deepcopy(model)  # the fp64 reference starts from the same parameters and buffers
        torch.manual_seed(0)
        outs_a, grads_a = _step(model, inputs)
        torch.manual_seed(0)
        outs_b, grads_b = _step(fused, inputs)
        assert len(outs_a) == len(outs_b)
        assert grads_a.keys() == grads_b.keys()
        for key, g in grads_a.items():
            assert (g is None) == (grads_b[key] is None), key
        pairs = [(f"output {i}", a, b) for i, (a, b) in enumerate(zip(outs_a, outs_b))]
        pairs += [(key, g, grads_b[key]) for key, g in grads_a.items() if g is not None]
        if not all(_close(a, b) for _, a, b in pairs):
            _nearer_the_truth_than_twice_eager(before, inputs, mode, pairs)
    model.train()
    fused.train()
    eager = activation_bytes(lambda: _call(model, inputs), exclude=tuple(model.parameters()))
    ours = activation_bytes(lambda: _call(fused, inputs), exclude=tuple(fused.parameters()))
    record_property("activation_ratio", ours / eager)
    assert ours <= eager
    assert plan.saved_bytes == eager - ours  # the chains counted together (cost.CostModel.fused_total), exactly
    if plan.saved_bytes:  # QKV alone saves no activation bytes (the input is saved once either way)
        assert ours < eager


def test_embedded_encoder_keeps_its_memory_target():
    model, inputs = zoo.build("encoder", batch=4, seq=64)  # dropout at the model's default
    fused, _ = ol.fusion.fuse(model.train(), inputs)
    eager = activation_bytes(lambda: model(*inputs), exclude=tuple(model.parameters()))
    ours = activation_bytes(lambda: fused(*inputs), exclude=tuple(fused.parameters()))
    assert ours / eager <= 0.5


@pytest.mark.parametrize("name", ["bert", "roberta"])
def test_hf_encoders_meet_the_memory_target_at_bert_base_shapes(name):
    """BERT-base widths, 12 layers, 2x128, dropout at the defaults (0.1), training: fused/eager <= 0.85."""
    model, inputs = zoo.build(name, size="base", batch=2, seq=128)
    inputs.pop("labels", None)  # the MLM loss's vocabulary softmax is the LM-head chain, not the encoder's
    fused, plan = ol.fusion.fuse(model.train(), inputs)
    assert plan.summary()["qkv"] == {"fused": 12, "rejected": 0}
    eager = activation_bytes(lambda: model(**inputs), exclude=tuple(model.parameters()))
    ours = activation_bytes(lambda: fused(**inputs), exclude=tuple(fused.parameters()))
    assert ours / eager <= 0.85  # measured 0.837 (BertForMaskedLM) and 0.835 (RobertaModel)


def _eligible_conv_bn_act(model, inputs) -> int:
    """Conv -> BN chains whose conv output goes only to the BN and whose BN output is read only by an
    activation, counted on the run-time record independently of the pattern table."""
    from opsnn_lab.fusion.graph import ACTIVATIONS
    from opsnn_lab.fusion.runtime import trace_runtime

    g = trace_runtime(model, (), inputs).graph
    count = 0
    for bn in g.nodes:
        conv = g.producer(bn) if bn.op == "batch_norm" and bn.kind == "module" else None
        if conv is None or conv.op != "conv2d" or len(g.users[conv.name]) != 1:
            continue
        users = g.users[bn.name]
        count += len(users) == 1 and users[0].op in ACTIVATIONS
    return count


@pytest.mark.parametrize("name, act", [("mobilenet_v2", "relu6"), ("efficientnet", "silu")])
def test_every_conv_bn_act_chain_whose_bn_feeds_only_the_activation_fuses(name, act):
    model, inputs = zoo.build(name, dropout=0.0)
    plan = ol.fusion.analyze(model.train(), inputs)
    conv = [d for d in plan.decisions if d.pattern.startswith("conv_bn_")]
    fused = [d for d in conv if d.fused]
    eligible = _eligible_conv_bn_act(model, inputs)
    assert eligible > 10 and len(fused) == eligible
    assert {d.pattern for d in fused} == {f"conv_bn_{act}"}
    for d in conv:
        if not d.fused:  # the BN output goes to an add, a pad, a conv or several readers: not the chain
            assert re.search(r"not a ReLU or another activation|goes to `", d.reason), d.reason


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_documented_head_and_loss_recipe_on_the_fused_model(name):
    """ol.ops.lm_head_loss on the fused model = the HF loss of the eager model, loss and every gradient."""
    model, inputs = zoo.build(name, dropout=0.0)
    fused = ol.fusion.fuse(model.train(), inputs)[0]
    ids, mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"].clone()
    labels[:, ::2] = -100
    want = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    got = ol.ops.lm_head_loss(fused, ids, labels, attention_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    model.zero_grad(set_to_none=True)
    want.backward()
    got.backward()
    grads = dict(fused.named_parameters())
    for key, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[key].grad, p.grad, rtol=1e-4, atol=1e-5 * max(1.0, p.grad.abs().max()),
                                       msg=key)


def test_noise_floor_only_for_gradients_eager_gets_no_digit_of():
    truth = {"bn.weight": torch.tensor([8e3, -2.0], dtype=torch.float64),
             "bn.bias": torch.tensor([1e-12, -1e-12], dtype=torch.float64),
             "fc.bias": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    noise = torch.tensor([2e-3, -1e-3])  # eager's bias gradient: cancellation noise of 1.7 ulps of 8e3
    assert _noise_floor("bn.bias", noise, truth) == pytest.approx(NOISE_ULPS * 2 ** -23 * 8e3)
    assert _noise_floor("bn.weight", truth["bn.weight"].float(), truth) is None  # eager has digits here
    assert _noise_floor("fc.bias", torch.tensor([1.0, 2.0001]), truth) is None
    # a fused bias gradient off by a real amount still fails against the floor
    with pytest.raises(AssertionError, match="bn.bias"):
        assert_within_eager_error(torch.tensor([0.5, 0.0]), noise, truth["bn.bias"],
                                  floor=_noise_floor("bn.bias", noise, truth), name="bn.bias")


@pytest.mark.parametrize("name", ["llama", "phi3"])
def test_decoders_with_a_cache_and_a_padded_mask_fuse_their_residual_norms(name):
    """Training with the config's default ``use_cache=True``: every layer gets the model's key/value cache, and
    with padding the mask has the keys' length. The layers trace from the cache as each call found it, both
    residual adds of each layer fuse with their norms, and the fused model's loss, gradients and returned cache
    are eager's."""
    model, inputs = zoo.build(name, dropout=0.0)
    assert model.config.use_cache
    inputs["attention_mask"][:, :3] = 0  # left padding
    fused, plan = ol.fusion.fuse(copy.deepcopy(model).train(), inputs)
    adds = [d.route for d in plan.decisions if d.pattern == "add_rms_norm" and d.fused]
    assert adds == ["fx:model.layers.0", "fx:model.layers.1"], [(d.route, d.reason) for d in plan.decisions
                                                                if d.pattern == "add_rms_norm"]
    model.train()
    want, got = model(**inputs), fused(**inputs)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(want.past_key_values.layers, got.past_key_values.layers):
        torch.testing.assert_close(b.keys, a.keys)
        torch.testing.assert_close(b.values, a.values)
    want.loss.backward()
    got.loss.backward()
    grads = dict(fused.named_parameters())
    for key, p in model.named_parameters():
        torch.testing.assert_close(grads[key].grad, p.grad, rtol=1e-4, atol=1e-5 * max(1.0, p.grad.abs().max()),
                                   msg=key)


@pytest.mark.parametrize("name", ["bert", "roberta"])
def test_eager_attention_that_returns_its_weights_fuses_and_still_returns_them(name):
    # Hugging Face's eager attention returns its probabilities beside the output (the layer drops them unless
    # output_attentions is asked for): the core fuses all the same, its op returning the weights for reading,
    # and the T x T tensors eager saves (softmax output, dropout mask and product) are no longer kept
    from opsnn_lab.fusion.patterns import FAMILIES

    model, inputs = zoo.build(name, dropout=0.0, batch=2, seq=32)
    model.config._attn_implementation = "eager"
    inputs.pop("labels", None)
    fused, plan = ol.fusion.fuse(model.train(), inputs)
    assert plan.summary()["attention"] == {"fused": 2, "rejected": 0}
    torch.manual_seed(0)
    outs_a, grads_a = _step(model, inputs)
    torch.manual_seed(0)
    outs_b, grads_b = _step(fused, inputs)
    for a, b in zip(outs_a + list(grads_a.values()), outs_b + list(grads_b.values())):
        if a is not None:
            assert _close(a, b)
    want = model(**inputs, output_attentions=True).attentions  # asked for: eager's weights, from either model
    got = fused(**inputs, output_attentions=True).attentions
    assert len(got) == len(want) == 2
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a)
    without, _ = ol.fusion.fuse(model, inputs, patterns=[p for p in FAMILIES if p != "attention"])
    ours = activation_bytes(lambda: _call(fused, inputs), exclude=tuple(fused.parameters()))
    rest = activation_bytes(lambda: _call(without, inputs), exclude=tuple(without.parameters()))
    heads, seq = model.config.num_attention_heads, 32
    assert rest - ours >= 2 * 2 * heads * seq * seq * 4  # per layer at least the fp32 probabilities of 2 sequences


def test_default_sdpa_attention_with_dropout_fuses_past_its_size_checks_and_one_token_runs_the_original():
    # Hugging Face's SDPA attention decides `is_causal = q_length > 1 and ...` from query.shape[2]: answered from
    # the example and guarded (fusion/specialise.py). With dropout, SDPA's CPU math path keeps the T x T
    # probabilities and mask; the fused core keeps q, k, v and the mask. A one-token call misses the guard and
    # runs the original forward; both draw make_reproducible's masks, fused or not.
    from opsnn_lab.fusion.patterns import FAMILIES

    model, inputs = zoo.build("bert", batch=2, seq=32)  # default attention (sdpa), default dropouts (0.1)
    assert model.config._attn_implementation == "sdpa"
    inputs.pop("labels", None)
    fused, plan = ol.fusion.fuse(model.train(), inputs)
    assert plan.summary()["attention"] == {"fused": 2, "rejected": 0}
    region = next(r for r in plan.routes if r["path"] == "bert.encoder.layer.0.attention.self")
    assert region["route"] == "fx" and region["answers"][0][:1] == ["bool"] and region["answers"][0][2] is True
    assert "q_length > 1" in region["answers"][0][1]
    without, _ = ol.fusion.fuse(model, inputs, patterns=[p for p in FAMILIES if p != "attention"])
    ours = activation_bytes(lambda: _call(fused, inputs), exclude=tuple(fused.parameters()))
    rest = activation_bytes(lambda: _call(without, inputs), exclude=tuple(without.parameters()))
    heads, seq = model.config.num_attention_heads, 32
    assert rest - ours >= 2 * 2 * heads * seq * seq * 4  # per layer at least the fp32 probabilities of 2 sequences
    query = "bert.encoder.layer.0.attention.self.query.weight"
    for batch in (inputs, {k: v[:, :1] for k, v in inputs.items()}):
        (a, ga), (b, gb) = _reproducible_steps((model, fused), batch, query)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-5)


def test_t5_sdpa_encoder_attention_fuses_past_its_dtype_question_and_patched_norms():
    # T5's SDPA path asks torch.finfo(key.dtype) to build its position-bias mask (answered from the example and
    # guarded), and its T5LayerNorm, asked about its weight's dtype while the analysis traces, is patched at module
    # level before the rewrite traces the layer again: the answers are matched question by question (kind and
    # line), not by position. Encoder cores fuse through fx; the decoder's update the cache before SDPA's size
    # questions, so fx cannot trace them, and their SDPA calls are redirected at the call (module:sdpa).
    model, inputs = zoo.build("t5", batch=2, seq=16)  # default attention (sdpa), dropout 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed fx rewrite warns
        fused, plan = ol.fusion.fuse(model.train(), inputs)
    done = {d.modules[0]: d.route for d in plan.decisions if d.pattern == "attention" and d.fused}
    assert done == {**{f"encoder.block.{i}.layer.0.SelfAttention": f"fx:encoder.block.{i}.layer.0" for i in (0, 1)},
                    **{f"decoder.block.{i}.layer.{j}.{name}": "module:sdpa" for i in (0, 1)
                       for j, name in ((0, "SelfAttention"), (1, "EncDecAttention"))}}
    for weight in ("encoder.block.0.layer.0.SelfAttention.q.weight", "decoder.block.1.layer.0.SelfAttention.q.weight",
                   "decoder.block.0.layer.1.EncDecAttention.k.weight"):
        (a, ga), (b, gb) = _reproducible_steps((model, fused), inputs, weight)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)


def test_gpt2_sdpa_attention_fuses_with_a_cache_at_the_call_and_without_one_through_fx():
    # GPT-2's layers update the model's key/value cache (config use_cache=True, also in training) before SDPA
    # asks `kv_length > q_length`: a call missing that guard would update the cache twice, so the layer is not
    # traced (the routes name the line and the cache) and its SDPA call is redirected at the call; with
    # use_cache=False the layer traces and the core fuses through fx. Both draw make_reproducible's masks.
    for use_cache, route in ((True, "module:sdpa"), (False, "fx:transformer.h.{}.attn")):
        model, inputs = zoo.build("gpt2", batch=2, seq=16)  # default attention (sdpa), attention dropout 0.1
        inputs.pop("labels", None)
        model.config.use_cache = use_cache
        fused, plan = ol.fusion.fuse(model.train(), inputs)
        assert [d.route for d in plan.decisions if d.pattern == "attention" and d.fused] == \
            [route.format(i) for i in (0, 1)], [d.reason for d in plan.decisions if d.pattern == "attention"]
        if use_cache:
            why = [r["reason"] for r in plan.routes if r["path"].endswith(".attn")]
            assert len(why) == 2 and all("`update`" in w and "kv_length > q_length" in w and "use_cache = False" in w
                                         for w in why), why
        (a, ga), (b, gb) = _reproducible_steps((model, fused), inputs, "transformer.h.0.attn.c_attn.weight")
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)


def test_a_fused_eager_attention_draws_the_mask_its_inline_dropout_draws_under_make_reproducible():
    # the fused core absorbs an inline F.dropout: its stream is the one make_reproducible names that call by
    # ("<module>:dropout.<i>"), so fused and unfused models draw the same masks (8e-3 apart before it was named)
    model, inputs = zoo.build("bert", batch=2, seq=16)  # the default dropouts, 0.1
    model.config._attn_implementation = "eager"
    inputs.pop("labels", None)
    fused, plan = ol.fusion.fuse(model.train(), inputs)
    assert plan.summary()["attention"] == {"fused": 2, "rejected": 0}
    (a, ga), (b, gb) = _reproducible_steps((model, fused), inputs, "bert.encoder.layer.0.attention.self.query.weight")
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-5)
