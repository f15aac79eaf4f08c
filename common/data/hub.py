"""The Hugging Face Hub: a dataset downloaded, or read from the `datasets` cache when offline.

An unreachable Hub is found in seconds, not after a minute of retries, and then only the
`datasets` cache is read; a failure is one line that says what to pass instead.
"""

from contextlib import contextmanager

from common.data.arrow import from_hf
from common.data.splits import ImageSource
from common.errors import UserError, first_line

HUB_REPOS = {"cifar10": "uoft-cs/cifar10", "cifar100": "uoft-cs/cifar100"}


def hub_repo(dataset: str) -> str:
    """The Hub repository of ``dataset``: uoft-cs/... for cifar10 and cifar100, else itself."""
    return HUB_REPOS.get(dataset, dataset)


def download(dataset: str) -> ImageSource:
    import datasets  # imported here: it takes a second, and only some sources need it

    repo = hub_repo(dataset)
    offline = datasets.config.HF_HUB_OFFLINE or not _hub_reachable(datasets.config.HF_ENDPOINT)
    try:
        with _datasets_offline(offline):
            splits = datasets.load_dataset(repo)
    except Exception as e:  # offline, the datasets cache is all there is, failing in several ways
        if not (offline or isinstance(e, ConnectionError)):
            missing = ("DatasetNotFoundError", "FileNotFoundError", "RepositoryNotFoundError")
            if type(e).__name__ in missing:
                raise UserError(f"--dataset {dataset}: no such dataset on the Hugging Face Hub "
                                f"({first_line(e)}); check the id (owner/name) or pass --data-dir "
                                f"DIR") from None
            # e.g. a dataset of several configurations and no default, or a gated one and no token
            raise UserError(f"cannot load --dataset {dataset} from the Hugging Face Hub "
                            f"({first_line(e)}); load it once with datasets.load_dataset and "
                            f"save_to_disk, then pass --data-dir DIR") from None
        if datasets.config.HF_HUB_OFFLINE:
            why = "HF_HUB_OFFLINE is set"
        else:
            why = f"{datasets.config.HF_ENDPOINT} is unreachable"
        detail = "" if isinstance(e, ConnectionError) else f" ({first_line(e)})"
        raise UserError(f"cannot load --dataset {dataset}: {why} and the Hugging Face cache holds "
                        f"no usable copy of {repo}{detail}; pass --data-dir DIR with a local copy "
                        f"(e.g. torchvision's cifar-10-batches-py or a snapshot of the Hub "
                        f"repository), or use --dataset synthetic") from None
    how = ", offline from the datasets cache" if offline else ""
    return from_hf(splits, f"{repo} from the Hugging Face Hub{how}")


def _hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    # Without this check, an unreachable Hub costs 23 s of retries inside load_dataset before it
    # falls back to the datasets cache (measured with datasets 5.2 / huggingface_hub 2.4).
    import huggingface_hub

    try:
        huggingface_hub.get_session().head(endpoint, timeout=timeout)  # any HTTP answer will do
        return True
    except Exception:
        return False


@contextmanager
def _datasets_offline(offline: bool):
    """Make `datasets` read only its cache, as HF_HUB_OFFLINE=1 does.

    The variable is read once, when `datasets` is imported, and the scripts import it before we
    know the Hub is unreachable; its config flag is what its loaders check.
    """
    import datasets

    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = saved or offline
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved
