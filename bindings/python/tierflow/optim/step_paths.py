"""CPUAdamW's step paths, below step(): the stream's finish with the Python path beside it (Note [Gradient
streaming]), states on the host stepped in step(), states on NVMe (Note [NVMe optimizer faults]); each all or
nothing (Note [Atomic step] in optimizer/step_plan.hpp) and each parameter known by its content (Note [Weight
content] in adamw.py).

StepPaths is a part of CPUAdamW (its base class), split from adamw.py along this seam: it reads the state
CPUAdamW._setup makes (the copies, the state tier, the GPU share, the partition, the gradient stream) and is never
made on its own. Its methods stay methods of the optimizer, so a test may replace one on an instance
(test_step_atomic.py, test_partition.py)."""

from __future__ import annotations

import time
from typing import Optional

import torch

from .. import _C
from .._distributed import note_step
from .accepted import check_grad
from .copies import local_shard
from .gpu_share import plan_room


class StepPaths:
    """The step paths of CPUAdamW (see the module doc)."""

    def _clip_coefficient(self) -> tuple[float, bool]:
        """(clip coefficient, all gradients finite), with clip_grad_norm_'s own ops."""
        if self._max_grad_norm is None and not self._skip_nonfinite:
            return 1.0, True
        released = self._streaming.stream.released_norms() if self._offload_grads else {}
        if released:
            total = self._streaming.total_norm_with_released(self.param_groups, released)
        else:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            if not grads:
                return 1.0, True
            total = torch.nn.utils.get_total_norm(grads, 2.0)
            if hasattr(total, "full_tensor"):  # FSDP2's sharded gradients: the norm over every rank's shard
                total = total.full_tensor()
        finite = bool(torch.isfinite(total))
        if self._max_grad_norm is None:
            return 1.0, finite
        coef = torch.clamp(self._max_grad_norm / (total + 1e-6), max=1.0)
        return float(coef), finite

    def _step_all(self) -> bool:
        """step()'s work on this rank's parameters; returns whether the step was skipped (not finite)."""
        skipped = False
        self._python_stepped = []  # Note [Weight content]: a failed step's left none behind
        self._wait_worker()
        scale, finite = self._clip_coefficient()
        # Note [Distributed training]: early steps all redone in a multi-process run (an all-reduce) turn them off.
        watched = self.overlap_stats if self._plan.steps_during_backward(self._master_stale) else None
        path = self._plan.path(self._streaming is not None, finite)  # Note [Step plan]
        if path == _C.StepPath.skipped:
            if self._streaming is not None:
                self._streaming.stream.restore_grads()  # a skipped step leaves p.grad as torch's does
                self._streaming.stream.end_window()
            self._overlap_counts["skipped_steps"] += 1
            skipped = True
        elif path == _C.StepPath.streamed:
            # Note [Gradient streaming]: the stream commits or redoes what it carried and
            # sends the weights back; the Python path steps only what it left.
            self._push_groups()
            if self._fsdp_feed is not None:  # the identities finish() checks: each shard's .grad, p.grad's local
                self._fsdp_feed.sync_grads()
                self._fsdp_feed.mark_unseen_changes()
            # Note [Atomic step]: what can fail, the stream's and the Python path's, before anything commits.
            def prepare(frugal: bool) -> list:
                unhandled = self._streaming.stream.prepare_finish(scale, self._master_stale, frugal)
                # Note [Weight content]: parameters the user wrote since tierflow did: their masters are re-read.
                self._reread = {id(self._streaming._slot_params[i]) for i in self._streaming.stream.weights_changed()}
                self._stream_stepped = unhandled
                return self._prepare_groups(scale, [(group, params) for group, params in zip(
                    self.param_groups, self._streaming.python_path(self.param_groups, unhandled)) if params])

            try:
                prepared = prepare(False)
            except _C.OutOfMemoryError:  # the early steps' out-of-place results let go for the rest's room
                prepared = prepare(True)
            self._streaming.stream.commit_finish()
            for work in prepared:
                self._apply_group(*work)
            if self._sharded:  # the next forward's all-gathers read the shards: their weights are back first
                self._streaming.stream.synchronize()
                if self._fsdp_feed is not None:
                    self._fsdp_feed.after_step()
            if self._streaming.sizing_pending or self._gpu.auto:  # Note [Steady step]
                seen = self._streaming.window_seen()
                # The share first: the buckets are cut for what stays on the CPU, at a steady step after it.
                if not self._choose_gpu_share(seen):
                    self._streaming.size_buckets(seen)
        elif path == _C.StepPath.host:
            self._step_groups(scale, [(group, None) for group in self.param_groups])
            self._states.new_window()
        else:
            problems: list = []
            t0 = time.perf_counter_ns()
            try:
                for group in self.param_groups:
                    problems += self._step_group(group, scale) or []
            finally:
                self.python_step_ns += time.perf_counter_ns() - t0
            if problems:  # Note [NVMe optimizer faults]: the others stepped; a retry steps these
                self._copies.finish_uploads()
                self._master_stale = False
                raise self._states.step_error(problems, self.param_groups)
            self._states.new_window()
        if watched is not None:
            note_step(self, watched, scale)
        self._copies.finish_uploads()
        self._note_written()
        return skipped

    def _choose_gpu_share(self, seen: tuple) -> bool:
        """The GPU share's choice (auto) at this step, given the activation plan's room as a value (PlanRoom);
        the plan settles once the share took device memory after it was made. Returns whether any moved."""
        planner = self.activation_planner()
        if not self._gpu.choose(self.param_groups, self._runtime, self._streaming, self.state, seen,
                                plan=plan_room(planner)):
            return False
        if planner is not None:
            planner.settle(f"the CPU optimizer's GPU share took {self._gpu.took_bytes} bytes of the device for its "
                           "states after the plan was made")
        return True

    # -- Note [Weight content] ------------------------------------------------------------------------
    def _weight_written_by_user(self, p: torch.Tensor) -> bool:
        """True when p's bytes are not what tierflow last wrote into it (p.data edits between steps: WGAN's
        weight clipping): its master is re-read from p. The stream checks its own parameters."""
        if id(p) in self._reread:
            return True
        then = self._written.get(id(p))
        if then is None:
            return False
        now = _C._grad_content(self._copies.source(local_shard(p)).detach())
        return not now[2] or now != then  # not known (not contiguous): re-read (kept where p is its rounding)

    def _note_written(self) -> None:
        """After a step's writes are complete: what the next step compares each parameter this step wrote with
        (one it did not write keeps what it had: a user's write to it is still to be seen)."""
        self._reread = set()
        stream = self._streaming.stream if self._streaming is not None else None
        if stream is not None and self._stream_stepped:
            stream.note_written(self._stream_stepped)  # carried, stepped here: the stream compares them
        self._stream_stepped = []
        stepped, self._python_stepped = self._python_stepped, []
        for p in stepped:
            if self._streaming is None or not self._streaming.carries(p):
                self._written[id(p)] = _C._grad_content(self._copies.source(local_shard(p)).detach())

    def _step_group(self, group: dict, scale: float = 1.0, params: Optional[list] = None) -> Optional[list]:
        """States on NVMe: one group's step (Note [NVMe optimizer faults]: the parameters it could not step)."""
        options = self._options(group)
        gpu = self._gpu.ensure(self.param_groups)
        if self._partition is not None:  # Note [Partitioned optimizer]: the other ranks step theirs
            params = [p for p in (group["params"] if params is None else params) if self._partition.owns(p)]
            group = dict(group, params=params)
        return self._states.step_group(group, dict(options, grad_scale=scale) if scale != 1.0 else options,
                                       self.state, gpu, self._copies, self._init_state, self._master_stale)

    def _step_groups(self, scale: float, todo: list) -> None:
        """States on the host: one step of [(group, its params or None for all)], all or nothing (Note [Atomic
        step]): everything that can fail (new states, gradients' copies, staging) first, for every group; then
        the kernels and the weights' way back."""
        for work in self._prepare_groups(scale, todo):
            self._apply_group(*work)

    def _prepare_groups(self, scale: float, todo: list) -> list:
        """Note [Atomic step]: _prepare_group for each of [(group, its params or None)]; on a failure the states
        it made are dropped and it raises, having changed nothing a caller sees."""
        fresh: list = []  # parameters whose state this step made
        prepared = []
        t0 = time.perf_counter_ns()
        try:
            for group, params in todo:
                prepared.append(self._prepare_group(group, scale, params, fresh))
        except BaseException:
            for p in fresh:  # a state made for a step that did not happen: the next step() makes it again
                self.state.pop(p, None)
            raise
        finally:
            self.python_step_ns += time.perf_counter_ns() - t0  # Note [Step stats]: step()'s CPU optimizer time
        return prepared

    def _prepare_group(self, group: dict, scale: float, params: Optional[list], fresh: list) -> tuple:
        """Note [Atomic step]: a host-tier group's part of a step up to the kernels, writing nothing a caller
        sees: (options, members, copy_back, on_gpu)."""
        options = self._options(group)
        gpu = self._gpu.ensure(self.param_groups)
        if self._partition is not None:  # Note [Partitioned optimizer]: the other ranks step theirs
            params = [p for p in (group["params"] if params is None else params) if self._partition.owns(p)]
        members: list = []  # (its state, its gradient on the host, its output) per parameter stepped here
        copy_back: list = []
        on_gpu: list = []
        fetches: list = []
        for p in group["params"] if params is None else params:
            if p.grad is not None and id(p) in gpu:
                on_gpu.append(p)
            elif p.grad is not None:
                members.append(self._member(p, group, fetches, copy_back, fresh))
        if scale != 1.0:
            options = dict(options, grad_scale=scale)
        for transfer, _src in fetches:
            transfer.wait()
        return options, members, copy_back, on_gpu

    def _apply_group(self, options: dict, members: list, copy_back: list, on_gpu: list) -> None:
        """The kernels of a prepared group (_prepare_group), the step counts, and the new weights' way back."""
        if on_gpu:
            self._gpu.step(on_gpu, self.state, options)
        t0 = time.perf_counter_ns()  # Note [Step stats]: the CPU kernels and the weights' way back, not the GPU's
        try:
            self._apply_host_members(options, members, copy_back)
        finally:
            self.python_step_ns += time.perf_counter_ns() - t0

    def _apply_host_members(self, options: dict, members: list, copy_back: list) -> None:
        amsgrad = options["amsgrad"]
        for step, batch in _C.group_by_step([int(s["step"].item()) + 1 for s, _, _ in members]):
            batch = [members[i] for i in batch]
            self._runtime.adam_step(options, step, [s["master"] for s, _, _ in batch],
                                    [s["exp_avg"] for s, _, _ in batch], [s["exp_avg_sq"] for s, _, _ in batch],
                                    [s.get("max_exp_avg_sq") if amsgrad else None for s, _, _ in batch],
                                    [g for _, g, _ in batch], [out for _, _, out in batch])
            for s, _, _ in batch:
                s["step"] += 1
        # The states have stepped: every new weight goes to its parameter, past one whose write fails (a parameter
        # on NVMe keeps its values in host memory then: Note [Parameter moves]), and the first error goes on after.
        error: Optional[BaseException] = None
        for p, out in copy_back:
            try:
                self._copies.write_param(p, out)
            except Exception as e:  # noqa: BLE001  raised below, once every weight is written
                error = error or e
        if error is not None:
            raise error

    def _member(self, p: torch.Tensor, group: dict, fetches: list, copy_back: list, fresh: list) -> tuple:
        """p's part of a step on the host: (its state, whose step _apply_group counts; its gradient on the host,
        whose copy is put in ``fetches`` when it is in flight; where the kernel writes its new weights, put in
        ``copy_back`` when that is a staging buffer to copy into p). A state it makes is put in ``fresh``."""
        grad = local_shard(p.grad)
        check_grad(grad)
        state = self.state[p]
        if len(state) == 0:
            state = self._init_state(p, group)
            fresh.append(p)
        elif self._master_stale or self._weight_written_by_user(p):
            self._reconcile_master(state["master"], local_shard(p))  # the same master again on a retry
        self._python_stepped.append(p)  # (a failed step's are dropped by the retry's, which steps them again)
        if self._copies.staged(grad):
            host_grad, transfer, src = self._copies.fetch(grad)
            fetches.append((transfer, src))  # all gradients in flight at once; waited by the caller
        else:
            host_grad = grad.detach()
            if host_grad.device.type != "cpu" or not host_grad.is_contiguous():
                host_grad = host_grad.to("cpu").contiguous()
        home = self._copies.home(p)
        shard = local_shard(p)
        in_host_memory = shard.device.type == "cpu" and not self._copies.staged(shard)
        target = _C.StepPlan.weight_target(home is not None, in_host_memory, shard.is_contiguous())
        if target == _C.WeightTarget.home:
            out = home  # the next forward fetches it (Note [Optimizer copies])
        elif target == _C.WeightTarget.parameter:
            out = shard.detach()
        else:
            out = self._copies.staging(shard)
            copy_back.append((shard, out))
        return state, host_grad, out

    def _reconcile_master(self, master: torch.Tensor, p: torch.Tensor) -> None:
        """A stale master (the model or the optimizer was loaded): kept where p is its rounding (the master of a
        checkpoint whose model was loaded after its optimizer, whatever the order), else read from p."""
        current = self._copies.source(p)
        if master.shape == p.shape and torch.equal(master.to(p.dtype), current.to(master.device)):
            return
        self._copies.read_into(master, p)

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        """A fresh state for p; when making it fails (a full tier) p keeps none, so a later step starts it again."""
        try:
            if self._states.nvme:
                fresh = self._states.add(p, group, self._copies.source(local_shard(p)))  # FSDP2: its shard
            else:
                shard = local_shard(p)  # FSDP2: this rank's shard only (one copy of the states on the node)
                fmt = self._state_format  # Note [Optimizer state formats]
                fresh = {"exp_avg": self._copies.host_moment(shard, fmt),
                         "exp_avg_sq": self._copies.host_moment(shard, fmt)}
                if group["amsgrad"]:
                    fresh["max_exp_avg_sq"] = self._copies.host(shard, True)
                master = self._copies.host(shard, False)
                self._copies.read_into(master, shard)
                fresh["master"] = master
        except BaseException:
            if p in self.state and len(self.state[p]) == 0:
                del self.state[p]
            raise
        state = self.state[p]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state.update(fresh)
        if not self._states.nvme:
            self._register_state(p)
        return state
