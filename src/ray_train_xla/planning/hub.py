"""Hugging Face Hub ids where a model directory is expected (``load_pretrained``,
``pretrained_path``, ``export_pretrained(source=...)``, ``plan --model``).

A source that exists on disk is a path, whatever it looks like. One that does not and has the
Hub's form ``org/name`` (its repo id rules: letters, digits, ``-``, ``_``, ``.``), optionally
``org/name@revision`` (a branch, tag or commit; default ``main``), is a Hub id: huggingface_hub's
``snapshot_download`` fetches the files the caller needs into the Hugging Face cache and
answers with the snapshot directory. The cache, offline mode and token are huggingface_hub's own
(``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``; ``HF_HUB_OFFLINE``;
``HF_TOKEN`` or ``hf auth login``), read as it reads them, when it is first imported. Anything
else is neither, and keeps its caller's error. Pure: huggingface_hub is imported when an id is
resolved; neither torch nor Ray.
"""

from __future__ import annotations

import json
import os
import re

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
GENERATION_FILE = "generation_config.json"
# Files of a model directory that are not weights, copied to an export from its source.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "spiece.model")
# What a user is told a model source may be, in every error that refuses one.
SOURCES = "a Hugging Face Hub id (org/name, or org/name@revision)"

# huggingface_hub's REPO_ID_REGEX with the namespace required (utils/_validators.py).
_REPO_ID = re.compile(r"\b[\w\-.]{1,96}\b/\b[\w\-.]{1,96}\b", re.ASCII)
_COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_id(source: object) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when ``source`` is a Hub id: a string that is not an
    existing path, has no URI scheme and reads ``org/name`` or ``org/name@revision`` under the
    Hub's repo id rules (no ``--`` or ``..``, no ``.git`` ending); else None. A ``Path`` is a
    path."""
    if not isinstance(source, str) or "://" in source or os.path.exists(source):
        return None
    repo, at, revision = source.partition("@")
    if (not _REPO_ID.fullmatch(repo) or "--" in repo or ".." in repo or repo.endswith(".git")
            or (at and not revision)):
        return None
    return repo, revision or None


def hf_cache(cache_dir: str | None = None) -> str:
    """The Hugging Face cache directory ids are fetched into: ``cache_dir``, else
    huggingface_hub's (``HF_HUB_CACHE``, else ``$HF_HOME/hub``). ImportError without
    huggingface_hub, naming the fix."""
    try:
        from huggingface_hub import constants
    except ImportError as exc:
        raise ImportError("a Hugging Face Hub id is fetched with huggingface_hub: pip install "
                          "huggingface_hub (transformers brings it), or give a model "
                          "directory") from exc
    return os.path.abspath(os.path.expanduser(cache_dir or constants.HF_HUB_CACHE))


def snapshot(repo_id: str, revision: str | None = None, *, weights: bool = False,
             tokenizer: bool = False, cache_dir: str | None = None) -> str:
    """The snapshot directory of the Hub model ``repo_id`` at ``revision`` in the Hugging Face
    cache (``cache_dir``, default huggingface_hub's), holding ``config.json``; with ``weights``
    the safetensors files its index lists, else ``model.safetensors`` (never a repository's other
    safetensors files, such as a ``consolidated.safetensors`` beside the shards); with
    ``tokenizer`` the tokenizer files and ``generation_config.json`` it has. Files already in the
    cache are not fetched again. Raises FileNotFoundError or PermissionError naming the id, the
    cache and the fix (ImportError without huggingface_hub)."""
    first = [CONFIG_FILE] + ([INDEX_FILE] if weights else [])
    if tokenizer:
        first += [*TOKENIZER_FILES, GENERATION_FILE]
    where = _Where(repo_id, revision, cache_dir, weights, tokenizer)
    folder = where.download(first)
    required = [CONFIG_FILE]
    if weights:
        index = os.path.join(folder, INDEX_FILE)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                required += sorted(set(json.load(f).get("weight_map", {}).values()))
        else:
            required.append(SINGLE_FILE)
        commit = os.path.basename(folder)  # the same commit as the index, even if main moved
        folder = where.download(required[1:], commit if _COMMIT.fullmatch(commit) else revision)
    missing = [n for n in required if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        names = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        if where.offline():
            raise FileNotFoundError(
                f"{where.label}: the Hugging Face cache {where.cache()} holds only part of it "
                f"({names} missing from {folder}), and HF_HUB_OFFLINE=1 forbids fetching the "
                f"rest: {where.fix()}")
        raise FileNotFoundError(
            f"{where.label}: the repository has no {names} (snapshot {folder}): give a model "
            "with safetensors weights (one with PyTorch .bin weights only: convert it once, "
            "AutoModelForCausalLM.from_pretrained(id).save_pretrained(dir), and give dir)")
    return folder


class _Where:
    """One resolution: its id, revision and cache, the download, and the words of its errors."""

    def __init__(self, repo_id: str, revision: str | None, cache_dir: str | None,
                 weights: bool, tokenizer: bool):
        self.repo_id, self.revision, self.cache_dir = repo_id, revision, cache_dir
        self.weights, self.tokenizer = weights, tokenizer
        self.label = f"Hugging Face Hub id {repo_id}{'@' + revision if revision else ''}"

    def cache(self) -> str:
        return hf_cache(self.cache_dir)

    @staticmethod
    def offline() -> bool:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)

    def fix(self) -> str:
        """The command that fetches these files into this cache where the Hub can be reached,
        and the other ways out."""
        if self.weights or self.tokenizer:
            patterns = ["*.json"] + (["model*.safetensors"] if self.weights else [])
            patterns += ["*.model", "*.txt", "*.jinja"] if self.tokenizer else []
            files = " ".join(f'--include "{p}"' for p in patterns)
        else:
            files = CONFIG_FILE
        revision = f" --revision {self.revision}" if self.revision else ""
        return (f"fetch it once where the Hub can be reached (hf download {self.repo_id}"
                f"{revision} {files} --cache-dir {self.cache()}), "
                f"{'unset HF_HUB_OFFLINE, ' if self.offline() else ''}or give a model directory")

    def download(self, names: list[str], revision: str | None = None) -> str:
        try:
            import huggingface_hub
            from huggingface_hub import errors
        except ImportError:
            hf_cache()  # raises, naming the fix
        try:
            return huggingface_hub.snapshot_download(
                self.repo_id, revision=revision or self.revision, allow_patterns=names,
                cache_dir=self.cache_dir)
        except errors.GatedRepoError as exc:
            raise PermissionError(
                f"{self.label} is a gated model and {self._token()}: accept its terms on "
                f"https://huggingface.co/{self.repo_id} with your account, then give that "
                "account's token on every node (HF_TOKEN=hf_..., or hf auth login); cache "
                f"{self.cache()}") from exc
        except errors.RepositoryNotFoundError as exc:
            raise FileNotFoundError(
                f"{self.label}: no such model on the Hub (nor an existing path), or a private "
                f"one and {self._token()}: "
                f"check the id (a directory that exists is read as one), or give a token with "
                f"access (HF_TOKEN=hf_...); cache {self.cache()}") from exc
        except errors.RevisionNotFoundError as exc:
            raise FileNotFoundError(
                f"{self.label}: the repository has no revision {self.revision!r}: give one of "
                f"its branches, tags or commits after the @; cache {self.cache()}") from exc
        except errors.LocalEntryNotFoundError as exc:  # offline, or the Hub not reachable
            if self.offline():
                raise FileNotFoundError(
                    f"{self.label} is not in the Hugging Face cache {self.cache()} (nor an "
                    f"existing path), and HF_HUB_OFFLINE=1 forbids fetching it: {self.fix()}"
                ) from exc
            cause = exc.__cause__ or exc
            raise FileNotFoundError(
                f"{self.label}: the Hub could not be reached ({type(cause).__name__}: "
                f"{str(cause).splitlines()[0] if str(cause) else ''}) and the id is not in the "
                f"Hugging Face cache {self.cache()} (nor an existing path): {self.fix()}") from exc
        except errors.HfHubHTTPError as exc:  # 401: a token the Hub refuses
            raise PermissionError(f"{self.label}: the Hub refused the request ({exc}); give a "
                                  f"valid token (HF_TOKEN=hf_...); cache {self.cache()}") from exc

    @staticmethod
    def _token() -> str:
        from huggingface_hub import get_token

        return ("the token found (HF_TOKEN, or hf auth login) has no access to it" if get_token()
                else "no Hugging Face token was found")
