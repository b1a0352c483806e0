"""``--shard auto``: the shard (k, n) of this process from a batch scheduler's environment.

- Slurm job array (``sbatch --array=A-B[:S]``): k from SLURM_ARRAY_TASK_ID, n from SLURM_ARRAY_TASK_COUNT or
  SLURM_ARRAY_TASK_MIN/MAX (and SLURM_ARRAY_TASK_STEP); the array must be an evenly spaced range.
- Kubernetes Indexed Job: k from JOB_COMPLETION_INDEX (0-based), n from GDN_PARITY_SHARDS (set it to the Job's
  ``completions``; the pod cannot read that field itself).

Shards are 1-based (``k/n``, as ``--shard`` takes them); a missing or inconsistent variable is a ValueError that
names the variables.
"""

from __future__ import annotations

from collections.abc import Mapping

SLURM_VARS = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX",
              "SLURM_ARRAY_TASK_STEP")
K8S_INDEX, K8S_COUNT = "JOB_COMPLETION_INDEX", "GDN_PARITY_SHARDS"


def _int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--shard auto: {name}={text!r} is not an integer") from None


def _slurm(env: Mapping[str, str]) -> tuple[int, int]:
    task, count, lo, hi = (_int(env, v) for v in SLURM_VARS[:4])
    step = _int(env, "SLURM_ARRAY_TASK_STEP") or 1
    seen = ", ".join(f"{v}={env[v]}" for v in SLURM_VARS if v in env)
    if lo is None:
        if count is None:
            raise ValueError(f"--shard auto: SLURM_ARRAY_TASK_ID is set but neither SLURM_ARRAY_TASK_COUNT nor "
                             f"SLURM_ARRAY_TASK_MIN/MAX ({seen})")
        lo = 0 if hi is None else hi - (count - 1) * step
    if hi is None:
        hi = lo + ((count or 1) - 1) * step
    span = (hi - lo) // step + 1
    if step < 1 or hi < lo or (hi - lo) % step or (count is not None and count != span):
        raise ValueError(f"--shard auto: the Slurm array is not an evenly spaced range A-B[:S] ({seen}); submit "
                         f"it as --array=0-N (a list or a range with holes cannot be split into shards)")
    if task < lo or task > hi or (task - lo) % step:
        raise ValueError(f"--shard auto: SLURM_ARRAY_TASK_ID={task} is not in the array {lo}-{hi}:{step} ({seen})")
    return (task - lo) // step + 1, span


def _k8s(env: Mapping[str, str]) -> tuple[int, int]:
    index, count = _int(env, K8S_INDEX), _int(env, K8S_COUNT)
    if count is None:
        raise ValueError(f"--shard auto: {K8S_INDEX} is set but {K8S_COUNT} is not; set {K8S_COUNT} to the "
                         f"Indexed Job's completions")
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"--shard auto: {K8S_INDEX}={index} with {K8S_COUNT}={count} (need 0 <= index < count)")
    return index + 1, count


def shard_from_env(env: Mapping[str, str]) -> tuple[int, int]:
    """(k, n), 1-based, from a Slurm array task's or a Kubernetes Indexed Job pod's environment."""
    slurm, k8s = _int(env, "SLURM_ARRAY_TASK_ID") is not None, _int(env, K8S_INDEX) is not None
    if slurm and k8s:
        raise ValueError(f"--shard auto: both SLURM_ARRAY_TASK_ID and {K8S_INDEX} are set; unset one")
    if slurm:
        return _slurm(env)
    if k8s:
        return _k8s(env)
    raise ValueError(f"--shard auto needs a scheduler's index: SLURM_ARRAY_TASK_ID (with SLURM_ARRAY_TASK_COUNT or "
                     f"SLURM_ARRAY_TASK_MIN/MAX) in a Slurm job array, or {K8S_INDEX} with {K8S_COUNT} in a "
                     f"Kubernetes Indexed Job; none is set (give --shard k/n instead)")


__all__ = ["shard_from_env", "SLURM_VARS", "K8S_INDEX", "K8S_COUNT"]
