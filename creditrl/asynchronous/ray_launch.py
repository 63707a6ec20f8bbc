"""``creditrl async`` with ``asynchronous.launcher=ray``: the learner ranks and the samplers as
Ray actors, on the cluster at ``trainer.ray.address`` (or ``$RAY_ADDRESS``), else on a local
cluster bound to loopback (``init_ray``).

Placement: one placement group (``trainer.ray.placement_strategy``) with one bundle of
``trainer.ray.cpus_per_worker`` CPUs (and ``gpus_per_worker`` GPUs) per actor: learner ranks
first, then samplers. Each ``AsyncActor`` builds its ``Learner`` / ``Sampler`` inside itself
from the config sent as JSON and runs ``fit()`` / ``run()``; it answers JSON (exit code, error,
last traceback lines), never pickled objects of ours.

Network: on a local cluster the learner binds 127.0.0.1. On a named cluster it binds its own
node's address (``asynchronous.host`` and, when 0, ``port`` and ``dist_port`` are set here from
learner rank 0's node); a non-loopback address needs CURVE keys or
``asynchronous.allow_insecure``, as for the process launcher.

Nothing but a socket is shared (``actor_env``): the launcher reads the CURVE keys
(``asynchronous.curve_keys_dir`` on this machine, or ``CREDITRL_CURVE_*`` in its environment)
and hands each actor only its own in its Ray runtime environment (JSON, never pickled): the
learner its secret key and the samplers' public keys, a sampler the learner's public key and
its secret key; the actors' config names no key folder. An actor works in the launcher's
directory when its node has it, else in a folder of its node's own (``node_workdir``), said
at start-up; a sampler whose node does not see the learner's weight folder takes the wire
(``weight_server.choose_channel``) and keeps its outbox on its own disk (``state_dir``).

Supervision (``supervise_actors``), as the process launcher: the run ends when learner rank 0
finishes (the samplers it told to stop get ``grace_s``, then are killed), and as soon as any
actor raises, exits non-zero or dies: the launcher names its role and index, prints the error
and the last lines, kills the others and returns non-zero. A sampler actor that dies (its
process killed or lost with its node: ``RayActorError``) is restarted instead, at most
``asynchronous.max_sampler_restarts`` times each, said in one line (``fleet.SamplerRestarts``):
the dead actor is killed for good and a new one starts in the same bundle of the placement
group (the same node while that node lives, so the same outbox, which resends what was never
acknowledged; the learner answers ``duplicate`` to what it consumed already; on another node,
without that outbox, the learner's welcome tells it where to number its groups). One actor per
sampler id at any time: the new one starts only once Ray reports the old one dead. A sampler
that raises or answers an error is not restarted (it would fail the same way).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from creditrl.asynchronous.fleet import SamplerRestarts
from creditrl.asynchronous.settings import sampler_id_of
from creditrl.asynchronous.tails import TAIL_LINES, print_tail
from creditrl.asynchronous.transport import (
    CURVE_ENV,
    LEARNER_CURVE_ENV,
    curve_env,
    endpoint,
    uses_curve,
)
from creditrl.config import Config
from creditrl.config.loader import from_dict, to_dict
from creditrl.controller.placement import (
    actor_options,
    create_placement,
    rank_bundle,
    remove_placement,
)
from creditrl.errors import ConfigError, UserError
from creditrl.hosts import is_loopback
from creditrl.plain_text import as_markup, as_text, plain

__all__ = [
    "ActorRun",
    "AsyncActor",
    "actor_env",
    "launch_ray",
    "learner_host",
    "node_workdir",
    "supervise_actors",
]


def node_workdir(cwd: str) -> str:
    """Where an actor works on a node without the launcher's directory ``cwd``: a folder of
    that node's temporary directory named for ``cwd``, so an actor restarted there finds it."""
    digest = hashlib.sha256(cwd.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), "creditrl-actors", digest)


def actor_env(cfg: Config) -> dict[str, dict[str, str]]:
    """The environment each role's actors get (``"learner"``, ``"sampler"``): their CURVE keys,
    from this process's ``LEARNER_CURVE_ENV`` / ``CURVE_ENV`` where set, else from
    ``asynchronous.curve_keys_dir`` read here (``transport.curve_env``); empty without keys."""
    learner, sampler = curve_env(cfg.asynchronous)
    own = {name: os.environ[name] for name in (*LEARNER_CURVE_ENV, *CURVE_ENV)
           if os.environ.get(name)}  # fmt: skip
    if all(name in own for name in LEARNER_CURVE_ENV):
        learner = {name: own[name] for name in LEARNER_CURVE_ENV}
    if all(name in own for name in CURVE_ENV):
        sampler = {name: own[name] for name in CURVE_ENV}
    return {"learner": learner, "sampler": sampler}


class AsyncActor:
    """One learner rank or one sampler (wrapped with ``ray.remote`` by ``launch_ray``)."""

    def __init__(self, role: str, index: int, cwd: str) -> None:
        self.role, self.index = role, index
        self.workdir = ""  # the launcher's directory (relative paths mean what they meant there)
        if not os.path.isdir(cwd):  # a node without it: a folder of its own
            self.workdir = node_workdir(cwd)
            os.makedirs(self.workdir, exist_ok=True)
            cwd = self.workdir
        os.chdir(cwd)

    def __repr__(self) -> str:  # Ray prefixes the actor's output with this
        return f"{self.role}-{self.index}"

    def where(self) -> list[Any]:
        """[node address, node id, two ports free on that address, pid, the folder it works in
        when not the launcher's ("": the launcher's)]."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as first, socket.socket() as second:
            first.bind((host, 0))
            second.bind((host, 0))
            ports = [int(first.getsockname()[1]), int(second.getsockname()[1])]
        node = ray.get_runtime_context().get_node_id()
        return [host, node, *ports, os.getpid(), self.workdir]

    def run(self, cfg_json: str) -> str:
        """Build the learner rank or sampler and run it to its end. Answers JSON: ``code`` (0,
        the sampler's exit code, 2 for a UserError, 1 for any other exception), ``error`` and
        the last ``lines`` of the traceback."""
        try:
            cfg = from_dict(json.loads(cfg_json))
            code = self._learn(cfg) if self.role == "learner" else self._sample(cfg)
            return json.dumps({"code": int(code), "error": None, "lines": []})
        except UserError as err:
            print(plain(f"{self!r}: {err}"), file=sys.stderr)
            return json.dumps({"code": 2, "error": str(err), "lines": []})
        except Exception as err:
            text = traceback.format_exc()
            print(plain(text), file=sys.stderr, end="")
            lines = [line for line in text.splitlines() if line.strip()][-TAIL_LINES:]
            return json.dumps({"code": 1, "error": f"{type(err).__name__}: {err}", "lines": lines})

    def _learn(self, cfg: Config) -> int:
        from creditrl.asynchronous.learner import Learner
        from creditrl.controller.distributed import destroy_process_group, init_process_group
        from creditrl.workers.placement import placement_for

        a = cfg.asynchronous
        if a.learners > 1:
            placement = placement_for(cfg)
            init_process_group(
                self.index,
                a.learners,
                backend=placement.backend,
                device=placement.device,
                master_addr=a.host,
                master_port=a.dist_port,
                timeout_s=a.data_timeout_s + 60.0,
            )
        try:  # rank 0 takes the output folder's lock: one run at a time
            Learner(cfg, self.index, a.learners).fit()
        finally:
            destroy_process_group()
        return 0

    def _sample(self, cfg: Config) -> int:
        from creditrl.asynchronous.sampler import Sampler

        return Sampler(cfg, self.index).run()


@dataclass
class ActorRun:
    """One started actor: its role, index, handle, the reference of its ``run`` call, and
    whether that call has finished."""

    role: str
    index: int
    actor: Any
    ref: Any = None
    done: bool = False
    slot: int = 0  # its bundle in the placement group

    @property
    def name(self) -> str:
        """``learner rank 0`` / ``sampler 1 (s1)``."""
        if self.role == "learner":
            return f"learner rank {self.index}"
        return f"sampler {self.index} ({sampler_id_of(self.index)})"


def learner_host(cfg: Config, node_ip: str, named_cluster: bool) -> str:
    """The address the learner binds and the samplers connect to: 127.0.0.1 on a cluster
    started here, else the learner's node address, which must be loopback or secured (a
    one-line ConfigError naming the keys otherwise)."""
    if not named_cluster:
        return "127.0.0.1"
    a = cfg.asynchronous
    if not is_loopback(node_ip) and not uses_curve(a) and not a.allow_insecure:
        raise ConfigError(
            f"asynchronous.launcher=ray: the learner's node {node_ip} is not loopback, so its "
            "socket needs CURVE keys: set asynchronous.curve_keys_dir (`creditrl async "
            "--make-keys DIR`, on this machine) or asynchronous.allow_insecure=true"
        )
    return node_ip


def _outcome(run: ActorRun) -> tuple[int, str, list[str]]:
    """(exit code, what happened, last lines) of a finished ``run`` call; what happened to an
    actor whose process died starts with ``died``."""
    import ray
    from ray.exceptions import RayActorError, RayError, RayTaskError

    try:
        answer = json.loads(ray.get(run.ref))
        code, error = int(answer["code"]), answer["error"]
        lines = [str(line) for line in answer["lines"]][-TAIL_LINES:]
    except RayActorError as err:
        text = [line.strip() for line in str(err).splitlines() if line.strip()]
        first = " ".join(text[0].split())[:200] if text else ""
        return 1, f"died ({type(err).__name__}: {first})", text[-TAIL_LINES:]
    except RayTaskError as err:
        cause = getattr(err, "cause", None) or err
        lines = [line for line in str(err).splitlines() if line.strip()]
        return 1, f"raised {type(cause).__name__}: {cause}", lines[-TAIL_LINES:]
    except (RayError, ValueError, TypeError, KeyError) as err:
        return 1, f"gave no usable answer ({type(err).__name__}: {err})", []
    if code == 0:
        return 0, "finished", []
    return code, f"failed with code {code}" + (f": {error}" if error else ""), lines


def _kill(runs: Sequence[ActorRun]) -> None:
    import ray

    for run in runs:
        with contextlib.suppress(Exception):  # already gone, or the cluster is
            ray.kill(run.actor, no_restart=True)


def _report(run: ActorRun, code: int, words: str, lines: list[str], console: Any) -> int:
    console.print(
        f"[red]async:[/red] {as_markup(run.name)} "
        f"{as_markup(words.splitlines()[0] if words else '')}"
        "; stopping the run",
        markup=True,
        highlight=False,
        soft_wrap=True,
    )
    print_tail(console, run.name, lines, code)
    return code


def supervise_actors(
    learners: Sequence[ActorRun],
    samplers: Sequence[ActorRun],
    console: Any,
    grace_s: float = 60.0,
    poll_s: float = 0.5,
    restart: Callable[[ActorRun], None] | None = None,
    max_restarts: int = 0,
) -> int:
    """Wait for learner rank 0's ``run``; end the run as soon as any actor fails (see the module
    docstring), but with ``restart`` (which gives a sampler's run a new actor and ``run`` call)
    restart sampler actors that die, ``max_restarts`` times each. Returns 0 or the failed
    actor's code (1 when it died or raised); 130 on Ctrl-C. Every actor is killed before it
    returns."""
    import ray

    everyone = [*learners, *samplers]
    pending = {run.ref: run for run in everyone if not run.done}
    restarts = SamplerRestarts(max_restarts if restart is not None else 0)
    try:
        while not learners[0].done:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=poll_s)
            for ref in ready:
                run = pending.pop(ref)
                run.done = True
                code, words, lines = _outcome(run)
                if code != 0 and run.role == "sampler" and words.startswith("died"):
                    others = sum(not other.done for other in samplers)
                    action, line = restarts.decide(run.index, run.name, words, others)
                    if action != "stop":
                        console.print(as_text(line), soft_wrap=True, highlight=False)
                    if action == "restart":
                        _kill([run])  # for good: one actor per sampler id at a time
                        restart(run)
                        run.done = False
                        pending[run.ref] = run
                    if action != "stop":
                        continue
                if code != 0:
                    return _report(run, code, words, lines, console)
        if pending:
            ray.wait(list(pending), num_returns=len(pending), timeout=grace_s)
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        _kill(everyone)


def _launch_dir() -> str:
    """The directory actors work in where their node has it: the launcher's."""
    return os.getcwd()


def _new_actor(
    cfg: Config, placement: Any, slot: int, role: str, index: int, env: dict[str, str]
) -> Any:
    """A new ``AsyncActor`` (``role`` ``index``) in bundle ``slot`` of ``placement``, with
    ``env`` (``actor_env``) in its environment."""
    import ray

    options = actor_options(cfg.trainer.ray, placement, slot)
    if env:
        options["runtime_env"] = {"env_vars": dict(env)}
    return ray.remote(AsyncActor).options(**options).remote(role, index, _launch_dir())


def _start(
    cfg: Config, console: Any, envs: dict[str, dict[str, str]]
) -> tuple[Any, list[ActorRun], list[ActorRun]] | int:
    """The placement group and the actors (learner ranks, then samplers; ``envs`` by role), or
    an exit code after reporting a placement that did not happen in time."""
    import ray

    a, ray_cfg = cfg.asynchronous, cfg.trainer.ray
    roles = [("learner", r) for r in range(a.learners)]
    roles += [("sampler", i) for i in range(a.num_samplers)]
    bundle = rank_bundle(ray_cfg)
    placement = create_placement(ray_cfg, len(roles))
    timeout = cfg.trainer.call_timeout_s
    ready, _ = ray.wait([placement.ready()], timeout=timeout)
    if not ready:
        remove_placement(placement)
        console.print(
            f"[red]async:[/red] the Ray cluster did not place {len(roles)} actor(s) of "
            f"{bundle} (trainer.ray.cpus_per_worker / gpus_per_worker, placement_strategy="
            f"{ray_cfg.placement_strategy}) within {timeout:.0f} s (trainer.call_timeout_s); "
            f"it has {as_markup(ray.cluster_resources())}",
            highlight=False,
        )
        return 1
    runs = [
        ActorRun(role, index, _new_actor(cfg, placement, slot, role, index, envs[role]), slot=slot)
        for slot, (role, index) in enumerate(roles)
    ]
    return placement, runs[: a.learners], runs[a.learners :]


def _locate(runs: Sequence[ActorRun], timeout: float, console: Any) -> list[list[Any]] | int:
    """Each actor's ``where()``, or an exit code after naming the actor that did not start."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    refs = [run.actor.where.remote() for run in runs]
    places = []
    for run, ref in zip(runs, refs, strict=True):
        try:
            places.append(ray.get(ref, timeout=timeout))
        except (GetTimeoutError, RayError) as err:
            first = next((line for line in str(err).splitlines() if line.strip()), "")
            console.print(
                f"[red]async:[/red] {as_markup(run.name)} did not start as a Ray actor: "
                f"{type(err).__name__}: {as_markup(first.strip())}",
                highlight=False,
            )
            return 1
    return places


def launch_ray(cfg: Config, console: Any, grace_s: float = 60.0) -> int:
    """Run the learner rank(s) and samplers as Ray actors to completion under
    ``supervise_actors``; returns its code."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "asynchronous.launcher=ray needs the 'ray' package: pip install 'creditrl[ray]', "
            "or use asynchronous.launcher=processes"
        ) from None
    from creditrl.controller.ray_group import init_ray

    a = cfg.asynchronous
    named = bool(cfg.trainer.ray.address or os.environ.get("RAY_ADDRESS"))
    started = not ray.is_initialized()
    actors = a.learners + a.num_samplers  # the local cluster is sized for one bundle each
    sized = dataclasses.replace(
        cfg, trainer=dataclasses.replace(cfg.trainer, workers=actors, critic_placement="colocated")
    )
    envs = actor_env(cfg)  # the keys are read here, once; actors get them by environment
    init_ray(sized)
    placement, everyone = None, []
    try:
        begun = _start(cfg, console, envs)
        if isinstance(begun, int):
            return begun
        placement, learners, samplers = begun
        everyone = [*learners, *samplers]
        places = _locate(everyone, cfg.trainer.call_timeout_s, console)
        if isinstance(places, int):
            return places
        node_ip, _, free_port, free_dist_port, _, _ = places[0]
        host = learner_host(cfg, node_ip, named)
        keys_dir = None if envs["learner"] and envs["sampler"] else a.curve_keys_dir
        asynchronous = dataclasses.replace(
            a, host=host, port=a.port or free_port, dist_port=a.dist_port or free_dist_port,
            curve_keys_dir=keys_dir,
        )  # fmt: skip
        run_cfg = dataclasses.replace(cfg, asynchronous=asynchronous)
        nodes = ", ".join(
            f"{run.name} on {place[0]} ({place[1][:8]})"
            + (f" in its node's own {place[5]}" if place[5] else "")
            for run, place in zip(everyone, places, strict=True)
        )
        console.print(
            as_text(
                f"async on Ray: {len(learners)} learner rank(s) + {len(samplers)} sampler(s), "
                f"learner at {endpoint(host, asynchronous.port)}, output in "
                f"{cfg.trainer.output_dir}; nodes: {nodes}"
            ),
            soft_wrap=True,
        )
        cfg_json = json.dumps(to_dict(run_cfg))
        for run in everyone:
            run.ref = run.actor.run.remote(cfg_json)

        def restart(run: ActorRun) -> None:
            run.actor = _new_actor(cfg, placement, run.slot, run.role, run.index, envs[run.role])
            run.ref = run.actor.run.remote(cfg_json)

        limit = a.max_sampler_restarts
        return supervise_actors(learners, samplers, console, grace_s, restart=restart,
                                max_restarts=limit)  # fmt: skip
    finally:
        _kill(everyone)
        if placement is not None:
            remove_placement(placement)
        if started:
            ray.shutdown()
