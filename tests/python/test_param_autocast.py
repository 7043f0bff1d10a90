"""autocast with fp32 parameters offloaded (TIERFLOW_OFFLOAD_PARAMS=host|nvme; issue 38 item 2, Note [Parameter
casts] in bindings/python/tierflow/_param_casts.py).

Against the same loop under the same autocast without tierflow, bit for bit (a torch optimizer, which on the
emulated device steps the host copies in place), and with the device bytes held by 16-bit casts of the offloaded
weights measured: the storages of every aten::_to_copy of a parameter, watched by a dispatch mode during the
forward, still alive (held by autocast's cache or by autograd's saved tensors) at each op and at the forward's
end. Without tierflow's handling every weight's cast is alive at the forward's end.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import tierflow

WIDTH, BLOCKS, STEPS = 32, 4, 3
OPT_NONE = dict(offload_optimizer="none", min_offload_bytes=0)


class Block(nn.Module):
    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.adapter = nn.Linear(WIDTH, WIDTH, bias=False) if frozen else None
        if frozen:  # LoRA's shape: the base weights frozen (fp32 here, so autocast casts them), an adapter trained
            self.up.requires_grad_(False)
            self.down.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.down(torch.relu(self.up(x)))
        return y + self.adapter(x) if self.adapter is not None else y


class Net(nn.Module):
    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block(frozen) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class CastWatch(TorchDispatchMode):
    """Bytes of the live casts of ``params`` (each aten::_to_copy of one): the largest at any op, and now."""

    def __init__(self, params: list) -> None:
        super().__init__()
        self.ids = {id(p) for p in params}
        self.casts: list = []
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.ids:
            self.casts.append((StorageWeakRef(out.untyped_storage()), out.untyped_storage().nbytes()))
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())
        return out

    def live_bytes(self) -> int:
        return sum(n for ref, n in self.casts if not ref.expired() and _has_memory(ref))


def _has_memory(ref: StorageWeakRef) -> bool:
    """Whether a live storage has its memory (a cast's whose memory went with its use raises when read)."""
    try:
        torch.UntypedStorage._new_with_weak_ptr(ref.cdata).data_ptr()
    except RuntimeError:
        return False
    return True


def _cast_bytes(module: nn.Module) -> int:
    """What the 16-bit casts of ``module``'s parameters take."""
    return sum(p.numel() * 2 for p in module.parameters())


# The block runners' modes set by hand (a plan's mix): each path of theirs that can meet a saved cast.
RUNNER_MODES = ["swap", "keep", "recompute", "swap"]


def _train(wrapped: bool, cache: bool, frozen: bool = False, **settings) -> dict:
    torch.manual_seed(0)
    model = Net(frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    params = list(model.parameters())
    if wrapped:
        mixed = settings.get("offload_activations") == "mixed"
        if mixed:
            settings["offload_activations"] = "recompute"
        model, opt = tierflow.wrap(model, opt, device="emulated", **OPT_NONE, **settings)
        if mixed:
            for runner, mode in zip(model._tierflow_session.planner.runners, RUNNER_MODES):
                runner.mode = mode
    losses, at_end, peaks, settled = [], [], [], []
    for step in range(STEPS):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))
        watch = CastWatch(params)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            with watch:
                y = model(x)
            at_end.append(watch.live_bytes())
            peaks.append(watch.peak_bytes)
            if wrapped:  # what is still on the device once the copies under way (saved tensors leaving) are done
                model._tierflow_session.runtime.synchronize()
                settled.append(watch.live_bytes())
            loss = y.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return dict(losses=losses, state={k: v.detach().clone() for k, v in model.state_dict().items()},
                at_end=at_end, peaks=peaks, settled=settled, model=model,
                casts=tierflow.report()["params"]["casts"] if wrapped else None)


def _assert_bit_identical(run: dict, base: dict) -> None:
    assert run["losses"] == base["losses"]
    assert run["state"].keys() == base["state"].keys()
    for k, v in base["state"].items():
        assert torch.equal(run["state"][k], v), k


def _largest_unit_cast_bytes(model: Net) -> int:
    rest = _cast_bytes(model.embed) + _cast_bytes(model.head)
    return max(rest, max(_cast_bytes(b) for b in model.blocks))


def _placed(tier: str, nvme_dir: str) -> dict:
    return dict(offload_params=tier, nvme_paths=[nvme_dir]) if tier == "nvme" else dict(offload_params=tier)


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no_cache"])
@pytest.mark.parametrize("acts", ["none", "recompute", "auto", "mixed"])
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_autocast_trains_bit_for_bit_and_holds_a_units_casts_at_most(device, tier, acts, cache, nvme_dir):
    if device != "emulated":
        pytest.skip("a torch optimizer steps the host copies only on the emulated device")
    base = _train(False, cache)
    model = base["model"]
    # What autocast alone keeps: every weight's cast (but the first layer's without the cache: its input needs no
    # gradient, so no op saves its cast)
    every_weight = sum(p.numel() * 2 for n, p in model.named_parameters() if n.endswith("weight"))
    assert min(base["at_end"]) >= every_weight - (0 if cache else model.embed.weight.numel() * 2)
    run = _train(True, cache, offload_activations=acts, **_placed(tier, nvme_dir))
    _assert_bit_identical(run, base)
    unit = _largest_unit_cast_bytes(model)
    assert unit < every_weight // 3
    assert max(run["at_end"]) <= unit, run["at_end"]
    assert max(run["peaks"]) <= unit, run["peaks"]
    casts = run["casts"]
    assert casts["saved_as_recipes"] > 0 and casts["recast_bytes"] > 0, casts
    assert 0 < casts["use_peak_bytes"] <= unit, casts


def test_frozen_fp32_weights_casts_are_saved_activations(device):
    """A frozen weight's cast has no graph (Note [Parameter casts]): training is bit for bit; with activations on
    the device its cast stays until backward (the documented limit), with activations offloaded it leaves."""
    if device != "emulated":
        pytest.skip("a torch optimizer steps the host copies only on the emulated device")
    base = _train(False, True, frozen=True)
    model = base["model"]
    frozen_weights = sum(p.numel() * 2 for n, p in model.named_parameters()
                         if not p.requires_grad and n.endswith("weight"))
    kept = _train(True, True, frozen=True, offload_activations="none", offload_params="host")
    _assert_bit_identical(kept, base)
    assert min(kept["at_end"]) >= frozen_weights, kept["at_end"]
    moved = _train(True, True, frozen=True, offload_activations="host", offload_params="host")
    _assert_bit_identical(moved, base)
    assert max(moved["settled"]) <= _largest_unit_cast_bytes(model), moved["settled"]


def test_a_parameter_written_between_forward_and_backward_is_refused(device):
    """The recipe would cast the new values where autocast's saved cast held the old ones: refused, naming it."""
    if device != "emulated":
        pytest.skip("emulated device")
    torch.manual_seed(0)
    model, _ = tierflow.wrap(Net(), None, device="emulated", offload_params="host", offload_activations="none",
                             **OPT_NONE)
    weight = model.blocks[1].down.weight

    def write(grad: torch.Tensor) -> None:  # in backward, while block 1's parameters are on the device
        with torch.no_grad():
            weight.mul_(1.0)

    # After tierflow's own hooks: the gradient of block 1's output has opened its backward use.
    model.blocks[1].register_forward_hook(lambda m, a, out: [out.register_hook(write), None][1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(torch.randn(4, WIDTH))
    with pytest.raises(tierflow.TierflowError, match=r"parameter 'blocks\.1\.down\.weight' \[32, 64\] was "
                                                     "written in place between the forward"):
        y.float().sum().backward()


def test_a_cast_made_again_after_its_parameter_left_the_device_is_refused(device):
    """A recipe unpacked while its parameter is released (its unit's use over) names the parameter; while it is on
    the device, the cast made again is the cast, bit for bit."""
    if device != "emulated":
        pytest.skip("emulated device")
    from tierflow._param_casts import saved_cast

    torch.manual_seed(0)
    model, _ = tierflow.wrap(Net(), None, device="emulated", offload_params="host", offload_activations="none",
                             **OPT_NONE)
    recipes = []

    def keep(module, args, out):
        cast = module.weight.to(torch.bfloat16)
        recipe = saved_cast(cast.t())
        assert recipe is not None and torch.equal(recipe.materialize(), cast.t())
        recipes.append(recipe)

    model.blocks[2].down.register_forward_hook(keep)
    model(torch.randn(4, WIDTH))
    with pytest.raises(tierflow.TierflowError, match=r"parameter 'blocks\.2\.down\.weight' \[32, 64\] is not on "
                                                     "the device when backward reads its cast"):
        recipes[0].materialize()


class TwiceNet(Net):
    """Each block called twice in one forward (shared weights, as ALBERT's layers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(b(h))
        return self.head(h)


def test_a_block_called_twice_shares_one_cast_bit_for_bit(device, monkeypatch):
    """Every use in one autocast region shares autocast's one cached cast (Note [Parameter casts]): its memory goes
    with each use and comes back with the next, so a weight cast in two uses of one forward has one cast's 16-bit
    gradients summed first, as autocast computes it with its cache; and without the cache, as without it."""
    if device != "emulated":
        pytest.skip("a torch optimizer steps the host copies only on the emulated device")
    monkeypatch.setattr(sys.modules[__name__], "Net", TwiceNet)
    for cache in (True, False):
        base = _train(False, cache)
        run = _train(True, cache, offload_activations="none", offload_params="host")
        _assert_bit_identical(run, base)
        assert max(run["peaks"]) <= _largest_unit_cast_bytes(base["model"]), run["peaks"]


def test_the_casts_count_in_the_budget_and_the_report(device):
    """A use under autocast counts its 16-bit casts of its fp32 weights with its parameters (Note [Parameter
    casts]): the report's device peak of parameter bytes grows by them, and a budget that holds a unit's
    parameters but not its casts beside them is refused by name, never exceeded."""
    if device != "emulated":
        pytest.skip("a torch optimizer steps the host copies only on the emulated device")

    def peak(autocast: bool, **settings) -> int:
        torch.manual_seed(0)
        model = Net()
        model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device="emulated",
                                   offload_params="host", offload_activations="none", **OPT_NONE, **settings)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = model(torch.randn(4, WIDTH))
        y.float().sum().backward()
        out = tierflow.report()["params"]["device_peak_bytes"]
        tierflow.unwrap(model)
        return out

    block = sum(p.numel() * 4 for p in Net().blocks[0].parameters())
    plain, cast = peak(False), peak(True)
    assert block // 2 <= cast - plain <= 2 * block, (plain, cast, block)  # the casts of a use or two at once
    budget = block + block // 4  # one unit's parameters, not its casts beside them
    assert peak(False, gpu_memory=str(budget)) <= budget
    with pytest.raises(tierflow.OutOfMemoryError, match="TIERFLOW_GPU_MEMORY"):
        peak(True, gpu_memory=str(budget))


class TiedLM(nn.Module):
    """An embedding and a head that is the same weight (GPT-2's): the embedding never casts it, the head does."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, WIDTH)
        self.blocks = nn.ModuleList(Block(False) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 64, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


@pytest.mark.parametrize("between", [False, True], ids=["two_forwards", "no_grad_between"])
def test_two_forwards_of_a_tied_model_in_one_region_are_bit_for_bit(device, between):
    """DPO's chosen and rejected passes under one autocast (and an evaluation pass under no_grad between them): the
    tied weight's one cast is made where autocast makes it (tierflow never casts), so its gradient runs in the
    engine's order of the baseline; a pass without a graph leaves the cache to the passes waiting for backward
    (Note [Parameter casts]). Before: the tied weight's gradient differed from the second step, and the no_grad pass
    emptied the cache the first pass's casts were in."""
    if device != "emulated":
        pytest.skip("a torch optimizer steps the host copies only on the emulated device")

    def run(wrapped: bool) -> list:
        torch.manual_seed(0)
        model = TiedLM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if wrapped:
            model, opt = tierflow.wrap(model, opt, device="emulated", offload_params="host",
                                       offload_activations="none", **OPT_NONE)
        out = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            chosen, rejected = (torch.randint(0, 64, (4, 32), generator=g) for _ in range(2))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                a = model(chosen).float().logsumexp(-1).mean()
                if between:
                    with torch.no_grad():
                        model(rejected)
                loss = -F.logsigmoid(a - model(rejected).float().logsumexp(-1).mean())
            loss.backward()
            out.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
        if wrapped:
            tierflow.unwrap(model)
        return out

    base, got = run(False), run(True)
    for step, (b, g) in enumerate(zip(base, got)):
        for i, (x, y) in enumerate(zip(b, g)):
            assert torch.equal(x, y), f"step {step}, parameter {i}"


class NoGradBlockNet(Net):
    """Block 1 called again under no_grad inside the grad forward (a probe, an EMA teacher's pass)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, b in enumerate(self.blocks):
            h = b(h)
            if i == 1:
                with torch.no_grad():
                    probe = b(h)
                h = h + 0.0 * probe
        return self.head(h)


@pytest.mark.parametrize("case", ["no_grad_block", "regularizer", "reference"])
def test_casts_of_other_uses_are_left_as_autocast_keeps_them(device, case):
    """A use without a graph casts without the cache and leaves every cast in it (another pass's, another model's)
    alone, and a weight read after its use (a regulariser on it after the forward) gets its cast's memory back
    (Note [Parameter casts]). Before: tierflow emptied the whole cache after a no_grad use, so later passes cast
    again and their gradients were summed in fp32 (silently different), and the regulariser read a dropped cast."""
    if device != "emulated":
        pytest.skip("a torch optimizer steps the host copies only on the emulated device")

    def run(wrapped: bool) -> list:
        torch.manual_seed(0)
        model = NoGradBlockNet() if case == "no_grad_block" else Net()
        ref = Net() if case == "reference" else None  # a reference model whose parameters still require grad
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if wrapped:
            model, opt = tierflow.wrap(model, opt, device="emulated", offload_params="host",
                                       offload_activations="none", **OPT_NONE)
            if ref is not None:  # wrapped too: its no_grad uses are tierflow's
                ref, _ = tierflow.wrap(ref, None, device="emulated", offload_params="host",
                                       offload_activations="none", **OPT_NONE)
        out = []
        for step in range(STEPS):
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
                if case == "reference":
                    with torch.no_grad():
                        r = ref(x).float().mean()
                    loss = loss + model(x.flip(0)).float().pow(2).mean() + 0.0 * r
                if case == "regularizer":
                    w = model.blocks[2].down.weight
                    loss = loss + 1e-3 * (w @ w.t()).float().diagonal().sum()
            loss.backward()
            out.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
        if wrapped:
            tierflow.unwrap(model)
            if ref is not None:
                tierflow.unwrap(ref)
        return out

    base, got = run(False), run(True)
    for step, (b, g) in enumerate(zip(base, got)):
        for i, (x, y) in enumerate(zip(b, g)):
            assert torch.equal(x, y), f"step {step}, parameter {i}"
