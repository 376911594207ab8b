"""The authors' interface on our layers (`switchhead.layers`): against a short reference written here from the paper's
equations with the authors' tensor names and conventions, against our Transformers layer with the existing
module conversion's mapping, the exact cache, dropout under a shared RNG stream, every experts implementation,
compile and export, and the arguments it refuses."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import switchhead
from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.conversion.authors_format import state_dict_from_module
from switchhead.expert_ops import EXPERTS_IMPLEMENTATIONS
from switchhead.layers import AttentionMask, SigmaMoE, SwitchHeadRope, SwitchHeadXL

D, H, DH = 32, 4, 8
IMPLEMENTATIONS = sorted(EXPERTS_IMPLEMENTATIONS)


# ------------------------------------------------------------------------------------- the paper, written out
class PaperAttention(nn.Module):
    """SwitchHead (paper, eqs. 9-12) with the authors' tensor names, one head and one expert at a time: sigmoid
    routers, top-k per head, gates not renormalised; values routed by the source token, outputs by the destination
    token; RoPE on the first half of each head's channels, or XL's q . W_pk PE(j - i) term; the authors' dropout on
    the queries and their expert dropout (a dropped expert is not chosen, the gate stays its score)."""

    def __init__(self, experts, k, xl=False, dropout=0.0, expert_dropout=0.0):
        super().__init__()
        self.E, self.k, self.xl, self.dropout, self.expert_dropout = experts, k, xl, dropout, expert_dropout
        self.q, self.k_ = nn.Linear(D, H * DH, bias=False), nn.Linear(D, H * DH, bias=False)
        if experts > 1:
            self.v = nn.Parameter(torch.randn(H * experts, D, DH) / math.sqrt(D))
            self.o = nn.Parameter(torch.randn(H * experts, DH, D) / math.sqrt(H * DH))
            self.sel_v = nn.Parameter(torch.randn(H * experts, D) / math.sqrt(D))
        else:
            self.v = nn.Parameter(torch.randn(H * DH, D) / math.sqrt(D))
            self.o = nn.Parameter(torch.randn(D, H * DH) / math.sqrt(H * DH))
        self.sel_o = nn.Parameter(torch.randn(H * experts, D) / math.sqrt(D))
        if xl:
            self.pos_to_pk = nn.Parameter(torch.randn(H * DH, D) / math.sqrt(D))

    def state_dict(self, *args, **kwargs):  # the authors' key is k.weight
        return {("k.weight" if key == "k_.weight" else key): value for key, value in super().state_dict().items()}

    def route(self, x, router):
        scores = torch.sigmoid(F.linear(x, router).float())
        scores = scores.view(*x.shape[:2], H, self.E)
        ranked = scores
        if self.training and self.expert_dropout > 0:
            ranked = scores.masked_fill(torch.rand_like(scores) < self.expert_dropout, float("-inf"))
        index = ranked.topk(self.k, dim=-1).indices
        return torch.zeros_like(scores).scatter(-1, index, scores.gather(-1, index))  # [B, T, H, E]

    def forward(self, x, hidden=None):
        batch, length, _ = x.shape
        q = self.q(x).view(batch, length, H, DH).transpose(1, 2)
        k = self.k_(x).view(batch, length, H, DH).transpose(1, 2)
        if self.E > 1:
            gate_v = self.route(x, self.sel_v)  # the source side first, as the layer draws its expert dropout
            gate_o = self.route(x, self.sel_o)
            v = torch.stack([sum(gate_v[:, :, h, e, None] * (x @ self.v[h * self.E + e]) for e in range(self.E))
                             for h in range(H)], dim=1)  # [B, H, T, dh]
        else:
            v = F.linear(x, self.v).view(batch, length, H, DH).transpose(1, 2)
        q = F.dropout(q, self.dropout, self.training)
        if self.xl:
            scores = q @ k.transpose(-1, -2) / math.sqrt(DH)
            rel = torch.arange(length)[None, :] - torch.arange(length)[:, None]  # j - i
            freq = torch.exp(torch.arange(0, D, 2).float() * (-math.log(10000.0) / D))
            pe = torch.stack((torch.sin(rel[..., None] * freq), torch.cos(rel[..., None] * freq)), -1).flatten(-2)
            pk = F.linear(pe, self.pos_to_pk).view(length, length, H, DH)  # [i, j, H, dh]
            scores = scores + torch.einsum("bhid,ijhd->bhij", q, pk) / math.sqrt(DH)
        else:
            q, k = self.rope(q), self.rope(k)
            scores = q @ k.transpose(-1, -2) / math.sqrt(DH)
        if hidden is None:
            hidden = torch.ones(length, length, dtype=torch.bool).triu(1)
        attended = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ v  # [B, H, T, dh]
        if self.E == 1:
            attended = attended * torch.sigmoid(F.linear(x, self.sel_o)).transpose(1, 2)[..., None]
            return F.linear(attended.transpose(1, 2).flatten(2), self.o)
        return sum(gate_o[:, :, h, e, None] * (attended[:, h] @ self.o[h * self.E + e]) for h in range(H)
                   for e in range(self.E))

    @staticmethod
    def rope(x):
        half = DH // 2  # rotate_fraction 0.5
        freq = 10000.0 ** (-torch.arange(0, half, 2).float() / half)
        angle = torch.arange(x.shape[2]).float()[:, None] * freq
        cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
        rot, rest = x[..., :half], x[..., half:]
        swapped = torch.cat((-rot[..., half // 2:], rot[..., : half // 2]), -1)
        return torch.cat((rot * cos + swapped * sin, rest), -1)


def _dropin(xl, experts, k=2, **kwargs):
    cls = SwitchHeadXL if xl else SwitchHeadRope
    return cls(D, H, experts, d_head=DH, moe_k=k if experts > 1 else 1, **kwargs)


def _compare(reference, dropin, x, hidden=None, mask=None, seed=None):
    """Outputs, input gradients and every tensor's gradient (by the authors' names) agree within 1e-5."""
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    if seed is not None:
        torch.manual_seed(seed)
    expected = reference(x1, hidden)
    if seed is not None:
        torch.manual_seed(seed)
    got, _ = dropin(x2, x2, x2, mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    weights = torch.randn_like(got)
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, atol=1e-5, rtol=1e-5)
    ours = {name: getattr(dropin, name.removesuffix(".weight")) for name in reference.state_dict()}
    theirs = dict(reference.named_parameters())
    for name, tensor in ours.items():
        tensor = tensor.weight if isinstance(tensor, nn.Linear) else tensor
        reference_tensor = theirs["k_.weight" if name == "k.weight" else name]
        torch.testing.assert_close(tensor.grad, reference_tensor.grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("xl", [False, True], ids=["rope", "xl"])
@pytest.mark.parametrize("experts", [4, 1])
def test_equals_the_paper_with_an_authors_state_dict(xl, experts, implementation):
    torch.manual_seed(0)
    reference = PaperAttention(experts, 2, xl)
    dropin = _dropin(xl, experts, experts_implementation=implementation)
    dropin.load_state_dict(reference.state_dict(), strict=True)
    assert list(dropin.state_dict()) == list(reference.state_dict()) or set(dropin.state_dict()) == set(
        reference.state_dict())
    _compare(reference, dropin, torch.randn(2, 7, D))


@pytest.mark.parametrize("xl", [False, True], ids=["rope", "xl"])
def test_masks_as_the_authors_define_them(xl):
    torch.manual_seed(0)
    reference, dropin = PaperAttention(4, 2, xl), _dropin(xl, 4)
    dropin.load_state_dict(reference.state_dict())
    length = 6
    padded = torch.zeros(2, length, dtype=torch.bool)
    padded[1, :2] = True  # two padding keys on the left of the second sequence
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)
    hidden = causal | padded[:, None, None, :]
    hidden[1, :, :2, :] = causal[:2]  # queries that would see no key at all: give them the causal row
    mask = AttentionMask(causal, padded)
    x = torch.randn(2, length, D)
    got, _ = dropin(x, x, x, mask)
    expected = reference(x, hidden)
    torch.testing.assert_close(got[1, 2:], expected[1, 2:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("xl", [False, True], ids=["rope", "xl"])
def test_query_dropout_under_a_shared_rng_stream(xl):
    torch.manual_seed(0)
    reference, dropin = PaperAttention(4, 2, xl, dropout=0.3).train(), _dropin(xl, 4, dropout=0.3).train()
    dropin.load_state_dict(reference.state_dict())
    _compare(reference, dropin, torch.randn(2, 5, D), seed=7)


def test_expert_dropout_under_a_shared_rng_stream():
    torch.manual_seed(0)
    reference = PaperAttention(4, 2, expert_dropout=0.3).train()
    dropin = _dropin(False, 4, expert_dropout=0.3).train()
    dropin.load_state_dict(reference.state_dict())
    _compare(reference, dropin, torch.randn(2, 5, D), seed=3)


# --------------------------------------------------------------------------------------------- our own layers
@pytest.mark.parametrize("xl", [False, True], ids=["rope", "xl"])
@pytest.mark.parametrize("experts", [4, 1])
def test_equals_our_transformers_layer_through_the_module_conversion(xl, experts):
    """The drop-in's state dict goes through the existing module conversion (`state_dict_from_module`) into a
    one-layer SwitchHeadForCausalLM; the model's attention then gives the drop-in's outputs."""
    torch.manual_seed(0)
    dropin = _dropin(xl, experts).eval()
    config = SwitchHeadConfig.from_preset(
        "tiny-switchhead", vocab_size=16, hidden_size=D, num_hidden_layers=1, num_attention_heads=H, head_dim=DH,
        num_attention_experts=max(experts, 2), num_attention_experts_per_tok=min(2, max(experts, 2)),
        position_encoding="xl" if xl else "rope", attention_type="switchhead" if experts > 1 else "dense",
        attention_output_gate=experts == 1)
    model = SwitchHeadForCausalLM(config).eval()
    theirs = {f"blocks.0.attn.{key}": value for key, value in dropin.state_dict().items()}
    ours = {key: value for key, value in model.state_dict().items() if ".self_attn." not in key}
    renames = {key: key for key in ours}
    converted = state_dict_from_module({**theirs, **ours}, config, "blocks.{i}.attn.", renames)
    model.load_state_dict(converted, strict=True)
    x = torch.randn(2, 6, D)
    positions = torch.arange(6)[None]
    embeddings = model.model.rotary_emb(x, positions) if not xl else None
    expected, _ = model.model.layers[0].self_attn(x, embeddings, None)
    got, _ = dropin(x, x, x, None)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ the cache
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("xl", [False, True], ids=["rope", "xl"])
def test_cached_decoding_equals_the_full_forward(xl, implementation):
    torch.manual_seed(0)
    dropin = _dropin(xl, 4, experts_implementation=implementation).eval()
    x = torch.randn(2, 9, D)
    with torch.no_grad():
        full, none = dropin(x, x, x, None)
        assert none is None  # no cache asked for, none returned
        prefix = x[:, :4]
        out, cache = dropin(prefix, prefix, prefix, None, {})
        steps = [out]
        chunk = x[:, 4:6]  # a chunk of two, then one token at a time
        out, cache = dropin(chunk, chunk, chunk, None, cache)
        steps.append(out)
        for t in range(6, 9):
            token = x[:, t:t + 1]
            out, cache = dropin(token, token, token, None, cache)
            steps.append(out)
    assert set(cache) == {"k", "v"} and cache["k"].shape == (2, H, 9, DH)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_cache_is_not_changed_in_place():
    dropin = _dropin(False, 4).eval()
    x = torch.randn(1, 3, D)
    _, cache = dropin(x, x, x, None, {})
    before = {key: value.clone() for key, value in cache.items()}
    token = torch.randn(1, 1, D)
    _, after = dropin(token, token, token, None, cache)
    assert after is not cache and all(torch.equal(cache[key], before[key]) for key in before)


# ------------------------------------------------------------------------------------- init, names, errors
@pytest.mark.parametrize("xl", [False, True], ids=["rope", "xl"])
def test_the_authors_initialisation(xl):
    """Drawn in the authors' order with their stds: under one seed, the same numbers as drawing them here."""
    torch.manual_seed(5)
    dropin = _dropin(xl, 4, init_scale=0.7)
    torch.manual_seed(5)
    nn.Linear(D, H * DH, bias=False), nn.Linear(D, H * DH, bias=False)  # the authors' constructor builds q and k
    shapes = {"sel_v": (H * 4, D), "sel_o": (H * 4, D)}
    expected = {}
    for name in ("sel_v", "sel_o"):
        weight = torch.empty(shapes[name]).normal_(0, 0.7 / math.sqrt(D))
        row_std = weight.std(dim=-1, keepdim=True)
        weight = weight / weight.norm(dim=-1, keepdim=True)
        expected[name] = weight * (row_std / weight.std())
    expected["k.weight"] = torch.empty(H * DH, D).normal_(0, 0.7 / math.sqrt(D))
    expected["q.weight"] = torch.empty(H * DH, D).normal_(0, 0.7 / math.sqrt(D))
    expected["v"] = torch.empty(H * 4, D, DH).normal_(0, 0.7 / math.sqrt(D))
    expected["o"] = torch.empty(H * 4, DH, D).normal_(0, 0.7 / math.sqrt(H * DH))
    if xl:  # left uninitialised by the authors' module (torch.empty); drawn last here
        expected["pos_to_pk"] = torch.empty(H * DH, D).normal_(0, 0.7 / math.sqrt(D))
    state = dropin.state_dict()
    assert set(state) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, msg=name)


@pytest.mark.parametrize(("arguments", "named"), [
    ({"n_experts": 2, "moe_k": 3}, "moe_k=3"),
    ({"d_head": 7}, "d_head=7"),
    ({"rotate_fraction": 0.25, "d_head": 12}, "rotate_fraction"),
    ({"n_heads": 0}, "n_heads"),
    ({"dropout": 1.5}, "dropout"),
    ({"experts_implementation": "grouped_mm"}, "experts_implementation"),
    ({"experts_implementation": "switchhead_fused", "dropout": 0.1}, "dropout=0.1"),
])
def test_bad_arguments_name_the_argument(arguments, named):
    with pytest.raises(ValueError, match=named):
        SwitchHeadRope(**{"d_model": D, "n_heads": H, "n_experts": 4, **arguments})


def test_bad_masks_and_inputs_name_the_argument():
    dropin = _dropin(False, 4)
    x = torch.randn(2, 5, D)
    with pytest.raises(ValueError, match="mask.position_mask"):
        dropin(x, x, x, AttentionMask(torch.zeros(4, 5, dtype=torch.bool)))
    with pytest.raises(ValueError, match="mask.src_length_mask"):
        dropin(x, x, x, AttentionMask(None, torch.zeros(2, 4, dtype=torch.bool)))
    with pytest.raises(ValueError, match="q_src, k_src and v_src"):
        dropin(x, torch.randn(2, 5, D), x, None)
    with pytest.raises(ValueError, match="kv_cache"):
        dropin(x, x, x, None, [])
    with pytest.raises(ValueError, match="mask"):  # XL sees no future keys: a mask that shows them is refused
        _dropin(True, 4)(x, x, x, AttentionMask(torch.zeros(5, 5, dtype=torch.bool)))


def test_top_level_names_are_lazy():
    assert switchhead.SwitchHeadRope is SwitchHeadRope and switchhead.SigmaMoE is SigmaMoE
    assert switchhead.AttentionMask is AttentionMask and switchhead.SwitchHeadXL is SwitchHeadXL


# -------------------------------------------------------------------------------------- compile and export
@pytest.mark.parametrize("xl", [False, True], ids=["rope", "xl"])
def test_compiles_fullgraph(xl):
    torch._dynamo.reset()
    dropin = _dropin(xl, 4).eval()
    x = torch.randn(2, 5, D)
    compiled = torch.compile(dropin, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, x, x, None)[0], dropin(x, x, x, None)[0])
        _, cache = compiled(x, x, x, None, {})
        token = torch.randn(2, 1, D)
        torch.testing.assert_close(compiled(token, token, token, None, cache)[0],
                                   dropin(token, token, token, None, cache)[0])


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _dropin(False, 4)

    def forward(self, x):
        return self.attn(x, x, x, None)[0]


def test_exports():
    block = _Block().eval()
    x = torch.randn(2, 5, D)
    program = torch.export.export(block, (x,))
    torch.testing.assert_close(program.module()(x), block(x))


# ------------------------------------------------------------------------------------------------- sigma-MoE
class PaperSigmaMoE(nn.Module):
    """The sigma-MoE (paper section on SwitchAll / sigma-MoE) with the authors' names: sigmoid router, top-k,
    y = sum_k s_e relu(x keys_e) values_e, and the regulariser sum_e p_e log p_e of the mean softmax."""

    def __init__(self, experts, size, k):
        super().__init__()
        self.k = k
        self.keys = nn.Parameter(torch.randn(experts, D, size) / math.sqrt(D))
        self.values = nn.Parameter(torch.randn(experts, size, D) / math.sqrt(experts * size))
        self.expert_sel = nn.Parameter(torch.randn(experts, D) / math.sqrt(D))

    def forward(self, x):
        logits = F.linear(x, self.expert_sel)
        gates, index = torch.sigmoid(logits).topk(self.k, dim=-1)
        out = 0
        for slot in range(self.k):
            e = index[..., slot]
            hidden = torch.relu(torch.einsum("btd,btds->bts", x, self.keys[e]))
            out = out + gates[..., slot, None] * torch.einsum("bts,btsd->btd", hidden, self.values[e])
        p = torch.softmax(logits.flatten(0, -2), -1).mean(0)
        return out, (p * p.log()).sum()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sigma_moe_equals_the_paper(implementation):
    torch.manual_seed(0)
    reference = PaperSigmaMoE(8, 6, 3)
    layer = SigmaMoE(D, 8, 6, 3, experts_implementation=implementation)
    layer.load_state_dict(reference.state_dict(), strict=True)
    assert set(layer.state_dict()) == {"keys", "values", "expert_sel"}
    x1 = torch.randn(2, 5, D, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    (expected, expected_loss), (got, got_loss) = reference(x1), layer(x2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_loss, expected_loss, atol=1e-5, rtol=1e-5)
    (expected.square().sum() + expected_loss).backward()
    (got.square().sum() + got_loss).backward()
    torch.testing.assert_close(x2.grad, x1.grad, atol=1e-5, rtol=1e-5)
    for name in ("keys", "values", "expert_sel"):
        torch.testing.assert_close(getattr(layer, name).grad, getattr(reference, name).grad, atol=1e-5, rtol=1e-5)


def test_sigma_moe_initialisation_and_arguments():
    torch.manual_seed(1)
    layer = SigmaMoE(D, 8, 6, 3, weight_std_scale=0.5)
    torch.manual_seed(1)
    keys = torch.empty(8, D, 6).normal_(std=D ** -0.5 * 0.5)
    values = torch.empty(8, 6, D).normal_(std=48 ** -0.5 * 0.5)
    sel = torch.empty(8, D).normal_(std=D ** -0.5 * 0.5)
    sel = sel / sel.norm(dim=1, keepdim=True) * (sel.std() / (sel / sel.norm(dim=1, keepdim=True)).std())
    for got, expected in ((layer.keys, keys), (layer.values, values), (layer.expert_sel, sel)):
        torch.testing.assert_close(got.detach(), expected)
    with pytest.raises(ValueError, match="k=9"):
        SigmaMoE(D, 8, 6, 9)
    with pytest.raises(ValueError, match="selection_mode"):
        SigmaMoE(D, 8, 6, 2, selection_mode="softmax")
    with pytest.raises(ValueError, match="bias"):
        SigmaMoE(D, 8, 6, 2, bias=True)
