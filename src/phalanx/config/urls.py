"""Storage URLs in a config: a scheme fsspec can write to, with the package it needs
installed, and a host or bucket where the scheme has one. Checked when the config is
read, so that a typo (``gopher://``, ``s3:/bucket``) fails the job at once, in one line,
instead of in every replica at its first save."""

from __future__ import annotations

WRITABLE = frozenset(
    {
        "file", "local", "memory",  # no host
        "s3", "s3a", "gs", "gcs", "abfs", "az", "adl", "oss", "oci", "ocilake", "tos",
        "tosfs", "hdfs", "arrow_hdfs", "webhdfs", "sftp", "ssh", "smb", "ftp", "dbfs",
        "webdav", "lakefs", "hf",
    }
)  # fmt: skip
"""fsspec protocols that store and list files (read-only ones such as ``http``,
``github`` or ``zip`` cannot hold checkpoints or rollouts)."""

HOSTLESS = frozenset({"file", "local", "memory"})

EXAMPLES = "a path, file:///path, s3://bucket/prefix, gs://bucket/prefix or memory://name"


def check_storage_url(value: str, what: str) -> str:
    """``value`` if it is a path or a writable fsspec URL, else a ValueError that says
    which part is wrong (pydantic turns it into the config's one-line error)."""
    if "://" not in value:
        if not value.strip():
            raise ValueError(f"{what} must be {EXAMPLES}: got {value!r}.")
        return value  # a local path
    scheme, rest = value.split("://", 1)
    scheme = scheme.lower()
    if scheme not in WRITABLE:
        raise ValueError(
            f"{what} must be {EXAMPLES}: got {value!r}, whose scheme {scheme!r} is not a "
            f"storage that can be written to (known: {', '.join(sorted(WRITABLE))})."
        )
    if scheme not in HOSTLESS and not rest.split("/", 1)[0]:
        raise ValueError(
            f"{what} must name the {scheme} host or bucket: got {value!r}, expected "
            f"{scheme}://HOST_OR_BUCKET/prefix."
        )
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as e:
        raise ValueError(f"{what} {value!r} needs a package that is not installed: {e}.") from e
    return value
