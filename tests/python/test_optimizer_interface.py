"""The CPU optimizer's public interface (issue 40): the DDP and FSDP2 feeds and the checkpoint code talk to
CPUAdamW through it, never through its private attributes, and the GPU share's choice takes the activation
plan's room as a value (optim/gpu_share.py: PlanRoom), not a reference into the planner."""

import ast
import os

import torch

import tierflow
from tierflow.optim.gpu_share import NO_PLAN, GpuShare, PlanRoom, plan_room

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "bindings", "python", "tierflow")
# The modules outside CPUAdamW that use it, and the names they give it.
USERS = ["optim/checkpoint.py", "_ddp_feed.py", "_fsdp_feed.py", "_distributed.py"]
NAMES = {"opt", "optimizer", "cpu_optimizer"}


def _private_reaches(path: str) -> list:
    """(line, what) for each private attribute read or written on the optimizer in the module at ``path``:
    opt._x, and getattr(opt, "_x", ...)."""
    tree = ast.parse(open(path).read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in NAMES \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            out.append((node.lineno, f"{node.value.id}.{node.attr}"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr") \
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in NAMES \
                and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_"):
            out.append((node.lineno, f"{node.func.id}({node.args[0].id}, {node.args[1].value!r})"))
    return out


def test_the_feeds_and_the_checkpoint_code_use_only_the_optimizers_public_interface():
    reaches = {m: r for m in USERS if (r := _private_reaches(os.path.join(PACKAGE, m)))}
    assert not reaches, f"private attributes of CPUAdamW used outside it (use its public interface): {reaches}"


def test_the_public_interface_is_documented():
    """Each member the feeds and checkpoint.py use says what it is (one line of doc at least)."""
    from tierflow.optim.adamw import CPUAdamW

    members = ["streaming", "state_format", "sharded", "states_on_nvme", "partition", "master_stale",
               "keep_loaded_layout", "settle_before_load", "describe", "exportable_state", "tier_stores",
               "weight_source", "host_moment", "host_tensor", "place_state", "check_amsgrad",
               "follow_activation_plan", "activation_planner"]
    undocumented = [m for m in members if not (getattr(CPUAdamW, m).__doc__ or "").strip()]
    assert not undocumented, undocumented


class _Planner:
    """What the share reads of an AutoPlanner: forced, plan; and settle, which the optimizer calls."""

    def __init__(self) -> None:
        self.forced = False
        self.plan = None
        self.settled = None

    def settle(self, why: str) -> None:
        self.settled = why


def test_a_planners_room_is_a_value():
    planner = _Planner()
    assert plan_room(None) == NO_PLAN == PlanRoom(True, 0), "no planner: nothing to wait for"
    assert plan_room(planner) == PlanRoom(in_force=False), "profiling: no plan in force yet"
    planner.forced = True
    assert plan_room(planner) == PlanRoom(True, 0), "a forced plan is in force, with no predicted peak"
    planner.forced, planner.plan = False, {"predicted_device_peak_bytes": 3 << 20}
    room = plan_room(planner)
    assert room == PlanRoom(True, 3 << 20)
    planner.plan = None
    assert room.in_force and room.predicted_peak_bytes == 3 << 20, "a value: the planner changing later is not seen"


def test_the_gpu_share_waits_for_a_room_not_in_force(device):
    """Note [Steady step]: handed a room whose plan is not in force, steady steps do not count; handed one in
    force, the share decides at a steady step (no CUDA parameter here: none moves, nothing to settle)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device=device)
    runtime = tierflow.current_session().runtime
    share, steady = GpuShare("auto"), (True, 10.0, False)
    for _ in range(tierflow._C.STEADY_STEP_LIMIT + 1):
        assert share.choose(opt.param_groups, runtime, opt.streaming, opt.state, steady,
                            plan=PlanRoom(in_force=False)) is False
    assert share.auto, "no plan in force: still waiting, nothing counted"
    ready = PlanRoom(True, 1 << 20)
    assert share.choose(opt.param_groups, runtime, opt.streaming, opt.state, steady, plan=ready) is False
    assert share.auto, "the first streamed step it sees is not steady"
    assert share.choose(opt.param_groups, runtime, opt.streaming, opt.state, steady, plan=ready) is False
    assert not share.auto and share.fraction == 0.0, "decided"
    tierflow.unwrap(model)


def test_the_optimizer_hands_the_share_the_room_of_the_plan_it_follows(device):
    """CPUAdamW.follow_activation_plan: the optimizer reads the plan's room at each step and hands it to the
    share's choice, which waits while no plan is in force and decides once one is."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device=device,
                               offload_activations="none", gpu_optimizer_fraction="auto")
    planner = _Planner()
    opt.follow_activation_plan(planner)
    assert opt.activation_planner() is planner

    def steps(n: int) -> None:
        for i in range(n):
            model(torch.randn(8, 16, generator=torch.Generator().manual_seed(i))).sum().backward()
            opt.step()
            opt.zero_grad()

    steps(tierflow._C.STEADY_STEP_LIMIT + 3)
    assert opt._gpu.auto, "no plan in force: the share still waits"
    planner.plan = {"predicted_device_peak_bytes": 0}
    steps(tierflow._C.STEADY_STEP_LIMIT + 1)  # a steady step, or the limit's, whatever the times measured
    assert not opt._gpu.auto, "a plan in force: the share decided"
    assert planner.settled is None, "nothing moved (no CUDA parameter): the plan may still change"
    tierflow.unwrap(model)
    del planner
    assert opt.activation_planner() is None, "held weakly"
