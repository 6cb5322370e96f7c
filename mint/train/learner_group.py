"""The learner group: the N learner rank actors of one session, and every call the driver makes to them.

The ranks share one torch.distributed group, so one dead rank breaks the others' collectives: every call goes to all
ranks at once and is gathered so that a dead rank fails it at once (`LearnerDied`), without waiting on the survivors,
which may be blocked in a collective that can never complete (gloo's default timeout is 30 minutes). Learners never
restart on their own (a restarted rank could not rejoin the old process group): after `LearnerDied` the driver ends
the session and starts a new one, whose group restores the latest checkpoint (`restore`). No call waits on a rank
any other way, start-up and `adapter_config` included, so a death there restarts the session as one in a step does.

`LearnerGroup` owns the rank actors' handles, where each runs (for the error lines), and the sizes that map a step's
plans to ranks (context parallel, expert parallel). Its verbs follow a step: `submit_learn` / `collect_learn` (one
optimizer step, queued and gathered separately so the driver can queue the next step's learning ahead),
`request_state` / `state` (the adapter's safetensors bytes, which stay in rank 0's object store for the rollout
actors), `save_checkpoint` / `restore`, and `close`.
"""

from __future__ import annotations

import ray
from ray.exceptions import RayActorError

from longstraw.trust import TrustCounts
from mint.config import Config
from mint.errors import MintError
from mint.train.context_parallel import cp_group_ranks
from mint.train.faults import Faults
from mint.train.learner import GroupBatch, LearnerActor
from mint.train.step import plan_step


class LearnerDied(MintError):
    """A learner rank died during a call; the group cannot go on without a restart."""


class LearnerGroup:
    """The learner ranks: N LearnerActors in one torch.distributed group, rank i at `actors[i]`."""

    def __init__(self, actors: list, context_parallel: int = 1, expert_parallel: int = 1):
        self.actors = actors
        self.where: list[str] = [""] * len(actors)  # "(pid 123 on 10.0.0.2, node 1a2b3c4d)" per rank
        self.context_parallel = context_parallel  # longstraw.context_parallel, learner.expert_parallel: how plans
        self.expert_parallel = expert_parallel  # map to ranks

    @classmethod
    def start(
        cls, config: Config, options: list[dict], paths: list[str], nodes: list[str], init_lora: bytes | None
    ) -> LearnerGroup:
        """Create one rank per entry of `options` (Ray options placing it in its bundle), rank i loading the model
        from `paths[i]` on node `nodes[i]`, and wire their process group (every rank joins at once, from `init_lora`
        when given). The caller closes the group when this raises after the actors exist."""
        n, faults = len(options), Faults.from_env()
        remote = ray.remote(LearnerActor)  # the class stays plain (importable: Ray pickles its methods by reference)
        group = cls(
            [remote.options(**options[i]).remote(config, paths[i], i, n, faults) for i in range(n)],
            config.longstraw.context_parallel,
            config.learner.expert_parallel,
        )
        try:  # through _gather like every call, so a rank that dies here is LearnerDied too: the session restarts
            addr, port = group._gather([group.actors[0].address.remote()], "start-up")[0]
            group._gather([lr.setup.remote(addr, port, init_lora) for lr in group.actors], "setup")
            places = group._gather([lr.where.remote() for lr in group.actors], "start-up")
        except BaseException:
            group.close()
            raise
        # "(pid N on IP)" plus the node id: several nodes may share an address (containers, a test cluster).
        group.where = [f"{p[:-1]}, node {node[:8]})" for p, node in zip(places, nodes, strict=True)]
        return group

    def _gather(self, futures: list, what: str) -> list:
        """ray.get of one call per rank (the first len(futures) ranks), in rank order, failing as soon as any rank
        has died. Every wait on a rank goes through here, so a death anywhere is `LearnerDied`, which restarts the
        session from the latest checkpoint.

        A plain ray.get(list) would wait on rank 0 while rank 1 is already dead and rank 0 blocks in a collective
        that can never complete.
        """
        index = {f: i for i, f in enumerate(futures)}
        results: list = [None] * len(futures)
        pending = list(futures)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            i = index[done[0]]
            try:
                results[i] = ray.get(done[0])
            except RayActorError as err:  # ActorDiedError, ActorUnavailableError
                raise LearnerDied(f"learner rank {i} {self.where[i]} died during {what}".replace("  ", " ")) from err
        return results

    def adapter_config(self, model_path: str) -> dict:
        """adapter_config.json as rank 0's PEFT model writes it (what every catalog revision is stored with)."""
        return self._gather([self.actors[0].adapter_config.remote(model_path)], "adapter_config")[0]

    def submit_learn(self, batches: list[GroupBatch], step: int) -> list:
        """Queue one optimizer step on every rank without waiting: the calls, in rank order (collect_learn)."""
        plans = plan_step(batches, len(self.actors), step, self.context_parallel, self.expert_parallel)
        return [lr.step.remote(p) for lr, p in zip(self.actors, plans, strict=True)]

    def collect_learn(self, futures: list, step: int) -> dict:
        """Wait for submit_learn's calls: the ranks' sums (loss, kl, clipped, tokens), maxima, the global gradient
        norm, whether the step was skipped (a non-finite gradient: nothing changed), and `learner_s`, the slowest
        rank's own seconds in the step."""
        per_rank = self._gather(futures, f"step {step}")
        # Under context parallel the first rank of each CP group reports its replica; its CP peers ran the same groups.
        blocks = cp_group_ranks(len(per_rank), self.context_parallel, self.expert_parallel)
        replicas = [per_rank[ranks[0]] for ranks in blocks]
        sums = {k: sum(r[k] for r in replicas) for k in ("loss", "kl", "clipped", "tokens")}
        sums.update({k: max(r[k] for r in per_rank) for k in ("peak_memory_mb", "logp_diff_max")})
        sums["learner_s"] = max(r["seconds"] for r in per_rank)
        sums["grad_norm"] = per_rank[0]["grad_norm"]  # already global: DeepSpeed reduces it across ranks
        sums["lr"] = per_rank[0]["lr"]
        sums["skipped"] = any(r["skipped"] for r in per_rank)
        sums["bad"] = any(r["bad"] for r in per_rank)
        causes = {r.get("bad_cause") for r in per_rank} - {None}
        if causes:  # a non-finite loss on any rank explains the others' non-finite gradients too
            sums["bad_cause"] = "loss" if "loss" in causes else "gradient"
        trust = TrustCounts()
        for r in replicas:
            trust.add(r["trust"])
        sums.update(trust.metrics())
        return sums

    def request_state(self) -> list:
        """Ask every rank for the adapter's safetensors bytes (rank 0's result holds them; every rank takes part,
        since the state may be gathered), without waiting. The calls queue behind the learning already queued, and
        the next step's learning may queue behind them (the overlapped loop)."""
        return [lr.lora_state_bytes.remote() for lr in self.actors]

    def state(self, refs: list, what: str = "publish") -> bytes:
        """Wait for request_state's calls: the bytes (rank 0's). `refs[0]` stays the object ref the rollout actors
        fetch them from, straight from the learner's node."""
        return self._gather(refs, what)[0]

    def save_checkpoint(self, directory: str) -> None:
        """Every rank writes its part of a checkpoint into `directory` (mint.train.checkpoint commits it)."""
        self._gather([lr.save_checkpoint.remote(directory) for lr in self.actors], "checkpoint")

    def restore(self, directory: str, revision: str) -> object:
        """Load checkpoint `directory` into every rank (each checks the adapter is `revision`); returns the object
        ref of rank 0's adapter bytes, for the rollout actors to load."""
        self._gather([lr.load_checkpoint.remote(directory, revision) for lr in self.actors], "restore")
        refs = self.request_state()
        self.state(refs, "restore")
        return refs[0]

    def param_digests(self) -> list[dict]:
        """Every rank's digests of its base and LoRA parameters, in rank order."""
        return self._gather([lr.param_digests.remote() for lr in self.actors], "digests")

    def kill(self, ranks: list[int]) -> None:
        """Kill these ranks at once (their node left): every call waiting on them fails now."""
        for i in ranks:
            ray.kill(self.actors[i], no_restart=True)

    def close(self) -> None:
        self.kill(list(range(len(self.actors))))
