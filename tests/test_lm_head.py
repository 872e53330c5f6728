"""auto_checkpoint(model, head="chunked") on Hugging Face causal LMs: the model's own loss, every
gradient but the head's bitwise, logits never whole, and a clear refusal where the loss is not
the model's plain ForCausalLMLoss."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import autockpt

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V = 500
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": V}  # fmt: skip


def gpt2() -> torch.nn.Module:  # a head tied to the token embedding
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def llama() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


def qwen2() -> torch.nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))


def gemma2() -> torch.nn.Module:  # final logit soft-capping
    cfg = transformers.Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=30.0)
    return transformers.Gemma2ForCausalLM(cfg)


def phi() -> torch.nn.Module:  # a head with a bias
    cfg = transformers.PhiConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, vocab_size=V)  # fmt: skip
    return transformers.PhiForCausalLM(cfg)


def head_params(model: torch.nn.Module) -> set[str]:
    head = model.get_output_embeddings()
    return {n for n, p in model.named_parameters() if p is head.weight or p is head.bias}


def train(model: torch.nn.Module, batches, **kw):
    """Losses and gradients of one accumulated step over ``batches``."""
    model.train()
    losses, logits = [], None
    for ids, labels in batches:
        out = model(input_ids=ids, labels=labels, **kw)
        out.loss.backward()
        losses.append(out.loss.detach())
        logits = out.logits
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return torch.stack(losses), grads, logits


def batches(count: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        ids = torch.randint(0, V, (2, 40), generator=g)
        labels = ids.clone()
        labels[:, : 5 + 3 * i] = -100  # padding
        out.append((ids, labels))
    return out


@pytest.mark.parametrize("make", [gpt2, llama, qwen2, gemma2, phi])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_gradient_but_the_heads_bitwise(make, dtype):
    """Three micro-batches accumulated with num_items_in_batch, as Hugging Face's Trainer
    passes it: the losses bitwise, every gradient bitwise except the head's (and the
    embedding tied to it), which are within the reassociation bound."""
    torch.manual_seed(0)
    plain = make().to(dtype)
    ours = autockpt.auto_checkpoint(copy.deepcopy(plain), head="chunked", head_chunks=3)
    data = batches(3)
    items = torch.tensor(sum(int((labels[:, 1:] != -100).sum()) for _, labels in data))
    want = train(plain, data, num_items_in_batch=items)
    got = train(ours, data, num_items_in_batch=items)
    assert torch.equal(got[0], want[0])
    assert got[2] is None and want[2] is not None
    heads = head_params(plain)
    assert want[1].keys() == got[1].keys()
    bound = 1e-12 if dtype == torch.float64 else 1e-5
    for name, g in want[1].items():
        if name in heads:
            assert ((got[1][name] - g).abs().max() / g.abs().max()).item() <= bound
        else:
            assert torch.equal(got[1][name], g), name


def test_mean_loss_bf16_autocast_and_logits_outside_training():
    """Without num_items_in_batch (the mean), under bf16 autocast; logits as before where
    no loss is computed with gradients."""
    torch.manual_seed(0)
    plain = llama()
    ours = autockpt.auto_checkpoint(copy.deepcopy(plain), head="chunked")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = train(plain, batches(1)), train(ours, batches(1))
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(got[1][n], g) for n, g in want[1].items() if n not in head_params(plain))
    ids, labels = batches(1)[0]
    with torch.no_grad():
        logits = plain(input_ids=ids, labels=labels).logits
        assert torch.equal(ours(input_ids=ids, labels=labels).logits, logits)
    assert ours(input_ids=ids).logits.shape == (2, 40, V)
    as_tuple = ours(input_ids=ids, labels=labels, return_dict=False)  # None fields are left out
    assert len(as_tuple) == 1 and as_tuple[0].dim() == 0  # the loss; no logits, no cache in training


def test_restore_and_whole_take_the_head_away():
    model = autockpt.auto_checkpoint(gpt2(), head="chunked")
    ids, labels = batches(1)[0]
    assert model(input_ids=ids, labels=labels).logits is None
    assert "LM head and loss in token chunks" in str(model.forward.plan)  # after the dry run's plan too
    autockpt.auto_checkpoint(model, head="whole")
    assert model(input_ids=ids, labels=labels).logits is not None
    autockpt.auto_checkpoint(model, head="chunked")
    autockpt.restore(model)
    assert "forward" not in vars(model) and model(input_ids=ids, labels=labels).logits is not None


def test_peak_below_the_whole_head():
    """The tracker's peak of a training step: the whole head's logits (2 x 128 tokens x
    5000 classes, 5 MiB, three of them alive in its backward) are gone."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=5000, n_positions=128)
    ids = torch.randint(0, 5000, (2, 128))
    peaks = []
    for head in ("whole", "chunked"):
        model = autockpt.auto_checkpoint(transformers.GPT2LMHeadModel(cfg), head=head)
        model(input_ids=ids, labels=ids).loss.backward()  # the dry run
        with autockpt.track_memory("cpu") as mem:
            model(input_ids=ids, labels=ids).loss.backward()
        peaks.append(mem.peak_bytes)
    logits = 2 * 128 * 5000 * 4
    assert peaks[0] - peaks[1] >= 2 * logits


def test_refusals_name_what_was_found():
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SMALL, num_local_experts=2))
    with pytest.raises(autockpt.AutockptError, match="changes the loss after computing it"):
        autockpt.auto_checkpoint(mixtral, head="chunked")
    assert "forward" not in vars(mixtral)
    with pytest.raises(autockpt.AutockptError, match=r"autockpt\.linear_cross_entropy"):
        autockpt.auto_checkpoint(torch.nn.Sequential(torch.nn.Linear(4, 4)), head="chunked")
    model = gpt2()
    model.lm_head.register_forward_hook(lambda *a: None)
    with pytest.raises(autockpt.AutockptError, match="forward hooks"):
        autockpt.auto_checkpoint(model, head="chunked")
    with pytest.raises(ValueError, match="head='half'"):
        autockpt.auto_checkpoint(gpt2(), head="half")
    with pytest.raises(autockpt.AutockptError, match="does not read it"):
        autockpt.auto_checkpoint(TinyLMClassLoss(), head="chunked")
    tiny = TinyLM()
    with pytest.raises(autockpt.AutockptError, match="mode='blocks'"):
        autockpt.auto_checkpoint(tiny, head="chunked", mode="graph")
    assert "forward" not in vars(tiny)


from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402


class TinyLM(torch.nn.Module):
    """The shape of a Hugging Face causal LM, with its loss_function property, that torch.fx
    can trace."""

    @property
    def loss_function(self):
        return self.__dict__.get("_loss_function", ForCausalLMLoss)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        self.lm_head = torch.nn.Linear(8, 50, bias=False)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def forward(self, x, labels=None):
        logits = self.lm_head(self.blocks(x))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, 50)
        return loss, logits


class TinyLMClassLoss(TinyLM):
    """Its loss function a class attribute, which head="chunked" cannot swap."""

    loss_function = staticmethod(ForCausalLMLoss)


def test_transformers_enable_takes_head():
    from autockpt.integrations.transformers import disable, enable

    model = enable(llama(), head="chunked")
    ids, labels = batches(1)[0]
    assert model(input_ids=ids, labels=labels).logits is None
    disable(model)
    assert model(input_ids=ids, labels=labels).logits is not None


def test_verify_holds_the_head_to_its_bound_and_the_rest_bitwise():
    model = autockpt.auto_checkpoint(gpt2().double(), head="chunked", head_chunks=3)
    ids, labels = batches(1)[0]
    report = autockpt.verify(model, (), example_kwargs={"input_ids": ids, "labels": labels})
    assert report.ok, report.mismatches
    assert report.param_grad_max_abs_diff == 0.0 and report.output_max_abs_diff == 0.0
    assert report.head_grad_rel_diff is not None and report.head_grad_rel_diff <= report.head_grad_bound
    assert "head gradients" in str(report)
    assert model(input_ids=ids, labels=labels).logits is None  # verify left the head on
    whole = autockpt.verify(model, (), example_kwargs={"input_ids": ids, "labels": labels}, head="whole")
    assert whole.ok and whole.head_grad_rel_diff is None


def test_a_budget_below_the_whole_heads_floor_needs_the_chunked_head():
    """The step's floor with the whole head is its logits; the error says what lowers it,
    and with head="chunked" the same budget is planned and kept."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=8000, n_positions=128,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    ids = torch.randint(0, 8000, (2, 128))
    example = {"example_kwargs": {"input_ids": ids, "labels": ids}, "loss_fn": lambda out: out.loss}
    model = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(autockpt.PlanInfeasibleError, match="head='chunked'") as err:
        autockpt.auto_checkpoint(model, budget=0.5, **example)
    assert "forward" not in vars(model)
    floor = err.value.min_budget_bytes
    assert floor is not None
    budget = floor // 2  # the same model object: the whole head's cached profile is not reused
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chunked = autockpt.auto_checkpoint(model, budget=budget, head="chunked", check=True, **example)
    assert not [w for w in caught if "no plan found that keeps it" in str(w.message)]
    assert chunked.forward.plan.budget_bytes == budget
    assert any("measured peak" in n for n in chunked.forward.plan.notes)


class ScaledHead(transformers.LlamaForCausalLM):
    """Falcon-H1's and HyperCLOVA X's pattern: a scale on the head's line."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = self.lm_head(hidden) * 0.5
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


class ZLoss(transformers.LlamaForCausalLM):
    """Bamba's pattern: more loss inside the labels block, after the loss function."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size)
            loss = loss + 0.1 * logits.logsumexp(-1).square().mean()
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


@pytest.mark.parametrize(
    ("cls", "match"), [(ScaledHead, "its head line is"), (ZLoss, "its loss is computed by")]
)
def test_more_on_the_head_or_loss_lines_is_refused(cls, match):
    with pytest.raises(autockpt.AutockptError, match=match):
        autockpt.auto_checkpoint(cls(transformers.LlamaConfig(**SMALL)), head="chunked")


@pytest.mark.parametrize("change", ["instance forward", "hook", "replaced", "loss function"])
def test_a_head_changed_after_wrapping_raises(change):
    model = autockpt.auto_checkpoint(llama(), head="chunked")
    ids, labels = batches(1)[0]
    if change == "instance forward":
        model.lm_head.forward = lambda x: torch.nn.Linear.forward(model.lm_head, x) * 0.5
    elif change == "hook":
        model.lm_head.register_forward_hook(lambda m, a, out: out * 0.5)
    elif change == "replaced":
        model.lm_head = torch.nn.Linear(32, V, bias=False)
    else:
        model.loss_function = ForCausalLMLoss
    with pytest.raises(autockpt.AutockptError, match="changed after auto_checkpoint"):
        model(input_ids=ids, labels=labels)


def test_a_failed_call_leaves_the_model_as_it_was():
    model = llama()
    with pytest.raises(autockpt.AutockptError):
        autockpt.auto_checkpoint(model, head="chunked", mode="graph")
    assert "forward" not in vars(model)
    ids, labels = batches(1)[0]
    autockpt.auto_checkpoint(model, head="chunked")
    with pytest.raises(autockpt.PlanInfeasibleError) as err:
        autockpt.auto_checkpoint(model, budget=1, example_kwargs={"input_ids": ids, "labels": labels})
    assert "head='chunked' they run" not in str(err.value)  # it has the chunked head already
    assert model(input_ids=ids, labels=labels).logits is None  # the chunked head is still on
    autockpt.auto_checkpoint(model)  # head=None keeps what the model has
    assert model(input_ids=ids, labels=labels).logits is None


class Wrapper(torch.nn.Module):
    """What PEFT's PeftModel is to its base model: merge_and_unload() returns the base."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base = base

    def forward(self, **kwargs):
        return self.base(**kwargs)


def test_restore_on_the_inner_model_of_a_checkpointed_wrapper():
    outer = autockpt.auto_checkpoint(Wrapper(llama()))
    inner = outer.base
    assert any("forward" in vars(m) for m in inner.modules())
    autockpt.restore(inner)  # raised "not checkpointed" before
    assert not any("forward" in vars(m) for m in inner.modules())
    with pytest.raises(autockpt.AutockptError, match="not checkpointed"):
        autockpt.restore(llama())


class PeftLike(Wrapper):
    """PEFT's PeftModel: a wrapper whose forward ends in the causal LM get_base_model() returns."""

    def get_base_model(self) -> torch.nn.Module:
        return self.base


def test_the_chunked_head_goes_on_the_model_inside_a_peft_wrapper():
    torch.manual_seed(0)
    plain = PeftLike(llama().double())
    ours = autockpt.auto_checkpoint(copy.deepcopy(plain), head="chunked")
    ids, labels = batches(1)[0]
    want, got = train(plain, [(ids, labels)]), train(ours, [(ids, labels)])
    assert torch.equal(got[0], want[0]) and got[2] is None
    heads = {f"base.{n}" for n in head_params(plain.base)}
    assert all(torch.equal(got[1][n], g) for n, g in want[1].items() if n not in heads)
    autockpt.restore(ours)
    assert not any("forward" in vars(m) for m in ours.modules())


def test_tradeoff_with_and_without_the_chunked_head():
    """Two sweeps show what chunking the head buys: a lower floor; the model is left as it was."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=8000, n_positions=128,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 8000, (2, 128))
    kw = {"example_kwargs": {"input_ids": ids, "labels": ids}, "loss_fn": lambda out: out.loss}
    kw.update(budgets=[], counts=[])
    whole = autockpt.tradeoff(model, (), **kw)
    chunked = autockpt.tradeoff(model, (), head="chunked", **kw)
    assert "forward" not in vars(model)
    assert chunked.floor_bytes < 0.6 * whole.floor_bytes


def test_a_head_line_with_another_name_or_contiguous_is_taken_over():
    """OPT's ``logits = self.lm_head(h).contiguous()``, Falcon's ``lm_logits = self.lm_head(h)``."""
    torch.manual_seed(0)
    size = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": V}
    opt_config = transformers.OPTConfig(**size, ffn_dim=64, word_embed_proj_dim=32, dropout=0.0,
                                        attention_dropout=0.0)  # fmt: skip
    falcon_config = transformers.FalconConfig(**size, hidden_dropout=0.0, attention_dropout=0.0)
    opt, falcon = transformers.OPTForCausalLM(opt_config), transformers.FalconForCausalLM(falcon_config)
    for plain in (opt.double(), falcon.double()):
        ours = autockpt.auto_checkpoint(copy.deepcopy(plain), head="chunked", head_chunks=3)
        want, got = train(plain, batches(1)), train(ours, batches(1))
        assert torch.equal(got[0], want[0]) and got[2] is None
        assert all(torch.equal(got[1][n], g) for n, g in want[1].items() if n not in head_params(plain))


def test_a_whole_head_budget_plan_says_what_the_head_holds():
    """Issue 36, point 3: with head="whole", the plan's notes count the head's tensors
    against the predicted peak and say what head="chunked" would hold."""
    from autockpt.plan import format_bytes

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=8000, n_positions=128)
    ids = torch.randint(0, 8000, (2, 128))
    example = {"example_kwargs": {"input_ids": ids, "labels": ids}, "loss_fn": lambda o: o.loss}
    model = autockpt.auto_checkpoint(transformers.GPT2LMHeadModel(cfg), budget=0.95, **example)
    note = next(n for n in model.forward.plan.notes if n.startswith("the LM head and loss hold"))
    assert format_bytes(3 * 256 * 8000 * 4) in note and "head='chunked' would hold" in note
    plain = autockpt.auto_checkpoint(llama(), budget=0.95, example_kwargs={"input_ids": ids[:, :40] % V})
    assert not any(n.startswith("the LM head and loss hold") for n in plain.forward.plan.notes)  # no labels
