"""verifiers.v1 environments as a user writes them in one file (no creditrl imports), for
tests/test_verifiers.py: a taskset of sums played by verifiers' own ``null`` harness (its chat
program, run in the subprocess runtime), and by ``Chat``, a harness of this file that runs its
chat loop in process (verifiers allows it: every model call still goes through the
interception), scripted per test: two turns, a rewritten history, a failure.

verifiers imports a taskset (and a harness) by module name, and this module is the taskset:
``taskset={"id": __name__}`` (creditrl has imported this file under its own module name).
"""

from __future__ import annotations

import verifiers.v1 as vf

QUESTIONS = [("What is 3 + 4?", "7"), ("What is 2 + 2?", "4")]


class SumData(vf.TaskData):
    answer: str
    judge_down: bool = False


class SumTask(vf.Task[SumData, vf.State]):
    @vf.reward(weight=1.0)
    async def says_answer(self, trace) -> float:
        if self.data.judge_down:
            raise ZeroDivisionError("judge is down")
        return float(self.data.answer in trace.last_reply)

    @vf.metric
    async def turns(self, trace) -> float:
        return float(trace.num_turns)


class SumTasksetConfig(vf.TasksetConfig):
    size: int = 2
    fail_scoring: bool = False


class SumTaskset(vf.Taskset[SumTask, SumTasksetConfig]):
    def load(self):
        for i in range(self.config.size):
            question, answer = QUESTIONS[i % len(QUESTIONS)]
            data = SumData(
                idx=i, prompt=question, answer=answer, judge_down=self.config.fail_scoring
            )
            yield SumTask(data, self.config.task)


class ChatConfig(vf.HarnessConfig):
    turns: int = 2
    mode: str = "plain"  # "stream"; "rewrite": the second request rewrites the first reply;
    # "raise"
    needs: str = ""  # a dependency of a (PEP 723) program prepared in setup()


class Chat(vf.Harness[ChatConfig]):
    """A chat loop run in process: ``turns`` model calls, "Are you sure?" between them."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def setup(self, runtime) -> None:
        if self.config.needs:
            script = f'# /// script\n# dependencies = ["{self.config.needs}"]\n# ///\nprint(1)\n'
            await runtime.prepare_uv_script(script)

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        from openai import AsyncOpenAI

        if self.config.mode == "raise":
            raise RuntimeError("the harness crashed")
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for turn in range(self.config.turns):
                if self.config.mode == "stream":
                    chunks = await client.chat.completions.create(
                        model=ctx.model, messages=messages, stream=True
                    )
                    content = "".join(
                        [c.choices[0].delta.content or "" async for c in chunks if c.choices]
                    )
                else:
                    reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                    content = reply.choices[0].message.content or ""
                if self.config.mode == "rewrite" and turn == 0:
                    content = "rewritten"
                messages.append({"role": "assistant", "content": content})
                messages.append({"role": "user", "content": "Are you sure?"})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["Chat", "SumTaskset"]


def _env(harness: dict, size: int = 2, **agent) -> vf.Env:
    agent = {"harness": harness, "runtime": {"type": "subprocess"}, **agent}
    taskset = {"id": __name__, "size": size, **agent.pop("taskset", {})}
    return vf.load_environment(vf.SingleAgentEnvConfig(taskset=taskset, agent=agent))


def load_environment(size: int = 2) -> vf.Env:
    """The null harness (verifiers' chat program, one reply without tools) on the sums."""
    return _env({"id": "null"}, size)


def chat(
    turns: int = 2, mode: str = "plain", fail_scoring: bool = False, needs: str = ""
) -> vf.Env:
    return _env(
        {"id": __name__, "turns": turns, "mode": mode, "needs": needs},
        taskset={"fail_scoring": fail_scoring},
    )


def remote_runtime() -> vf.Env:
    config = vf.SingleAgentEnvConfig(
        taskset={"id": __name__}, agent={"harness": {"id": "null"}, "runtime": {"type": "docker"}}
    )
    return vf.load_environment(config)


def pinned_client() -> vf.Env:
    client = {"type": "eval", "base_url": "http://127.0.0.1:9/v1", "api_key_var": "NO_KEY"}
    return _env({"id": "null"}, client=client)


_LOCAL_NULL = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}


class DuoConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig(**_LOCAL_NULL)
    judge: vf.AgentConfig = vf.AgentConfig(**_LOCAL_NULL)


class Duo(vf.Env[DuoConfig]):
    async def run(self, task, agents) -> None:
        await agents.solver.run(task)


def two_roles() -> vf.Env:
    return Duo(DuoConfig(taskset={"id": __name__}))
