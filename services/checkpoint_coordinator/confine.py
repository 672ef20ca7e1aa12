"""Confined checkpoint storage: the coordinator owns a storage root (`--checkpoint-root URI`), and each job's shards
must lie under its own prefix, `<root>/<tenant>/<job>/` (`<root>/<job>/` for a job without a tenant: authentication
off). A shard location anywhere else is refused: another job's prefix, a `..`, a symlink that leads out (file://
roots are compared after resolving every symlink), or another scheme or host.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class StorageRoot:
    """A parsed `--checkpoint-root`: a scheme (file for a plain path), a host, and an absolute path."""

    scheme: str
    host: str
    path: str

    @classmethod
    def parse(cls, text: str) -> StorageRoot:
        """'file:///ckpt', '/ckpt' (a local or shared file system), 's3://bucket/ckpt'; ValueError otherwise."""
        text = text.strip()
        if not text:
            raise ValueError("the checkpoint root is empty")
        parts = urlsplit(text)
        if not parts.scheme:
            if not text.startswith("/"):
                raise ValueError(f"checkpoint root {text!r}: give an absolute path or a URI such as file:///ckpt")
            return cls("file", "", posixpath.normpath(text))
        if parts.scheme == "file" and parts.netloc not in ("", "localhost"):
            raise ValueError(f"checkpoint root {text!r}: a file:// root names no host")
        raw = unquote(parts.path) or "/"
        path = posixpath.normpath(raw)
        if not path.startswith("/") or ".." in raw.split("/"):
            raise ValueError(f"checkpoint root {text!r}: its path must be absolute, without '..'")
        return cls(parts.scheme, "" if parts.scheme == "file" else parts.netloc, path)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}{self.path}"

    def prefix(self, tenant: str, job_id: str) -> str:
        """The job's own prefix, as a URI ending in '/'."""
        return f"{str(self).rstrip('/')}/{tenant + '/' if tenant else ''}{job_id}/"

    def _job_path(self, tenant: str, job_id: str) -> str:
        return posixpath.join(self.path, *([tenant] if tenant else []), job_id)

    def check(self, uri: str, tenant: str, job_id: str) -> str:
        """Why `uri` may not hold a shard of `job_id` (of `tenant`), or '' when it lies under the job's prefix."""
        if not _SAFE_NAME.fullmatch(job_id) or (tenant and not _SAFE_NAME.fullmatch(tenant)):
            return "the job or its tenant names no storage prefix"
        where = f"outside this job's storage prefix {self.prefix(tenant, job_id)}"
        parts = urlsplit(uri)
        if parts.scheme != self.scheme:
            return f"{where} (scheme {parts.scheme or 'none'!r}, not {self.scheme!r})"
        host = parts.netloc if self.scheme != "file" else ("" if parts.netloc in ("", "localhost") else parts.netloc)
        if host != self.host:
            return f"{where} (host {parts.netloc!r})"
        raw = unquote(parts.path)
        if "\x00" in raw or ".." in raw.split("/"):
            return f"{where} (its path has a '..')"
        job_path = self._job_path(tenant, job_id)
        if self.scheme == "file":
            # Every symlink resolved, the file's own included: a link planted under the prefix that leads out is
            # outside.
            resolved, base = os.path.realpath(raw), os.path.realpath(job_path)
        else:
            resolved, base = posixpath.normpath(raw), job_path
        if not resolved.startswith(base.rstrip("/") + "/"):
            return where
        return ""
