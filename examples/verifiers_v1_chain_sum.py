"""chain_sum (the task ``make run`` trains) as a verifiers 0.4 environment (``verifiers.v1``: a
``Taskset`` of tasks, played by verifiers' own ``null`` harness, the plain chat program);
trained by creditrl unchanged:

    creditrl train examples/verifiers_v1_chain_sum.yaml

``load_environment`` builds everything locally (nothing is downloaded): creditrl's own chain_sum
rows (the prompts ``make run`` sees) as tasks, each scored by the task's ``@vf.reward``
functions: 1 for the right number inside ``<answer></answer>``, half of that for a right last
number without tags, plus 0.1 for a reply that ends in one answer block. The agent plays in the
``subprocess`` runtime: verifiers runs the null harness's chat program on this machine, and its
model calls reach creditrl's endpoint. The first run prepares that program (creditrl runs it
with its own interpreter, which has the program's packages; otherwise verifiers installs them
with uv, once).

verifiers imports a taskset by module name; this module is the taskset (``taskset.id`` is its
``__name__``, the name creditrl imported this file under).
"""

from __future__ import annotations

import re

import verifiers.v1 as vf

from creditrl.config.schema import DataConfig
from creditrl.data.tasks import build_task_rows

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _same(predicted: str, answer: str) -> bool:
    try:
        return float(predicted.strip()) == float(answer)
    except ValueError:
        return False


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State]):
    @vf.reward(weight=1.0)
    async def correct_answer(self, trace) -> float:
        """1 for the right answer in the last <answer> block, 0.5 for a right last number."""
        text = trace.last_reply
        tagged = ANSWER.findall(text)
        if tagged:
            return float(_same(tagged[-1], self.data.answer))
        numbers = NUMBER.findall(text)
        return 0.5 * float(bool(numbers) and _same(numbers[-1], self.data.answer))

    @vf.reward(weight=0.1)
    async def answer_format(self, trace) -> float:
        """1 when the reply ends with its one <answer> block."""
        text = trace.last_reply
        return float(text.count("<answer>") == 1 and text.endswith("</answer>"))


class ChainSumConfig(vf.TasksetConfig):
    size: int = 2000
    seed: int = 0
    few_shot: int = 1


class ChainSum(vf.Taskset[SumTask, ChainSumConfig]):
    """make run's chain_sum prompts: the system prompt, a worked example, the question."""

    def load(self):
        c = self.config
        rows = build_task_rows(
            "chain_sum", DataConfig().task_kwargs, c.size, 0, c.seed, None, c.few_shot
        )
        for i, row in enumerate(rows.train):
            system = [m["content"] for m in row.messages if m["role"] == "system"]
            data = SumData(
                idx=i,
                system_prompt=system[0] if system else None,
                prompt=[m for m in row.messages if m["role"] != "system"],
                answer=str(row.ground_truth),
            )
            yield SumTask(data, c.task)


__all__ = ["ChainSum"]


def load_environment(size: int = 2000, seed: int = 0, few_shot: int = 1) -> vf.Env:
    """The chain_sum tasks played by the null harness in the subprocess runtime."""
    config = vf.SingleAgentEnvConfig(
        taskset={"id": __name__, "size": size, "seed": seed, "few_shot": few_shot},
        agent={"harness": {"id": "null"}, "runtime": {"type": "subprocess"}},
    )
    return vf.load_environment(config)
