"""A model of how Kubernetes' Job controller and JobSet's controller turn failed pods into a Job's
failure reason and the JobSet's action, for the rules accelerate_configs/kubernetes/runtime.yaml
uses. tests/test_kubernetes.py drives it with the exit statuses the simulated pods really ended
with, in every order in which the Job controller may see them fail.

Job controller, Kubernetes 1.36 (documented: kubernetes.io/docs/concepts/workloads/controllers/job,
"Pod failure policy", "Pod backoff failure policy", "Suspending a Job"; in kubernetes/kubernetes
pkg/controller/job/job_controller.go: syncJob, getFailJobMessage, trackJobStatusAndRemoveFinalizers,
manageJob, and pod_failure_policy.go):
- it reads the pods once per sync, and pods fail in whatever order they reach it;
- for a failed pod the podFailurePolicy's rules are read in order and the first that matches
  decides: FailJob, Ignore or Count; a pod no rule matches counts. onExitCodes reads the exit code
  of the container it names (0 never matches), onPodConditions a condition of that type whose
  status is the one given (default True);
- a failed pod that matches a FailJob rule fails the Job with reason PodFailurePolicy; syncJob
  looks for one (getFailJobMessage, every pod) before it compares the counted failures with
  backoffLimit, which fails the Job as BackoffLimitExceeded once they exceed it;
- the first failure a sync finds stays the Job's (the FailureTarget condition, then Failed);
- a suspended Job deletes its pods after removing their tracking finalizer (manageJob,
  deleteJobPods): their failures are never counted, and only a FailJob match can still fail it.

JobSet v0.12.0 (keps/262-ConfigurableFailurePolicy; pkg/controllers/failure_policy.go:
executeFailurePolicy, findFirstFailedPolicyRuleAndJob, the action appliers): for a failed child
Job the failurePolicy's rules are read in order, a rule matches a Job whose failure reason is in
onJobFailureReasons (empty: any); none matching: RestartJobSet. RestartJobSet adds one to
status.restarts and to status.restartsCountTowardsMax, or fails the JobSet (ReachedMaxRestarts)
once restartsCountTowardsMax has reached maxRestarts; RestartJobSetAndIgnoreMaxRestarts adds one
to restarts only; FailJobSet fails the JobSet.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Pod:
    """A failed pod as the Job controller reads it: its container's exit code and its conditions;
    ``tracked``: it still has the Job's tracking finalizer (not so once a suspended Job deleted it)."""
    name: str
    exit_code: int
    conditions: tuple[tuple[str, str], ...] = ()  # (type, status)
    container: str = "node"
    tracked: bool = True


def pod_failure_action(policy: dict | None, pod: Pod) -> str:
    """The action of the first rule of ``policy`` (a Job's podFailurePolicy) that ``pod`` matches."""
    for rule in (policy or {}).get("rules", []):
        codes = rule.get("onExitCodes")
        if codes is not None:
            named = codes.get("containerName") in (None, pod.container)
            inside = pod.exit_code in codes["values"]
            if named and pod.exit_code != 0 and (inside if codes["operator"] == "In" else not inside):
                return rule["action"]
        for pattern in rule.get("onPodConditions", []):
            if (pattern["type"], pattern.get("status", "True")) in pod.conditions:
                return rule["action"]
    return "Count"


@dataclass
class Job:
    """A Job of the JobSet: its failure reason once it has one."""
    spec: dict  # the Job's spec: backoffLimit, podFailurePolicy
    failed: list[Pod] = field(default_factory=list)
    reason: str | None = None

    def sync(self, newly_failed: list[Pod]) -> str | None:
        """One sync of the Job controller that finds ``newly_failed`` pods failed."""
        self.failed += newly_failed
        if self.reason is None:
            policy = self.spec.get("podFailurePolicy")
            if any(pod_failure_action(policy, pod) == "FailJob" for pod in self.failed):
                self.reason = "PodFailurePolicy"
            else:
                counted = [pod for pod in self.failed
                           if pod.tracked and pod_failure_action(policy, pod) not in ("Ignore", "FailJob")]
                if len(counted) > self.spec.get("backoffLimit", 6):
                    self.reason = "BackoffLimitExceeded"
        return self.reason


@dataclass
class JobSet:
    """The JobSet's restart counters and state."""
    failure_policy: dict
    restarts: int = 0
    restarts_count_towards_max: int = 0
    failed: str | None = None

    def on_job_failed(self, reason: str) -> str:
        """The action for a child Job that failed with ``reason``."""
        action = "RestartJobSet"
        for rule in self.failure_policy.get("rules", []):
            if not rule.get("onJobFailureReasons") or reason in rule["onJobFailureReasons"]:
                action = rule["action"]
                break
        if action == "FailJobSet":
            self.failed = "FailedByFailurePolicy"
        elif action == "RestartJobSet":
            if self.restarts_count_towards_max >= self.failure_policy.get("maxRestarts", 0):
                self.failed = "ReachedMaxRestarts"
            else:
                self.restarts += 1
                self.restarts_count_towards_max += 1
        elif action == "RestartJobSetAndIgnoreMaxRestarts":
            self.restarts += 1
        else:
            raise ValueError(f"the model has no rule for the action {action}")
        return action


def outcome(runtime: dict, pods: list[Pod]) -> tuple[str | None, str | None, int]:
    """The Job's failure reason, the JobSet's action and the restarts counted against maxRestarts
    when the Job controller sees ``pods`` fail in this order, one sync each, in the TrainingRuntime
    ``runtime`` (its JobSet's failurePolicy and its one replicated Job's spec)."""
    jobset_spec = runtime["spec"]["template"]["spec"]
    (replicated,) = jobset_spec["replicatedJobs"]
    job, jobset = Job(replicated["template"]["spec"]), JobSet(jobset_spec.get("failurePolicy", {}))
    for pod in pods:
        if job.sync([pod]) is not None:
            break
    if job.reason is None:
        return None, None, 0
    return job.reason, jobset.on_job_failed(job.reason), jobset.restarts_count_towards_max
