"""The server's own traffic, read back from its prefix cache on disk to train a drafter
on (`tandem draft train --from-traffic`): the token ids of the entries one model made
for the API keys given, never their KV, and nothing written anywhere.

An entry's header names its key's scope by a hash of the key's id, an HMAC of the key
under the folder's salt (`prefix_folder`): only someone holding a key can find its
entries, so the operator's keys select the operator's traffic and no other key's. A
server without keys keeps everything under one scope (""), read when no key is given.
Entries of one conversation are prefixes of each other (system prompt, prompt,
answer): only the longest of each is kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.model.identity import parameter_dtypes
from scheduler.prefix_disk import MEMO, target_identity
from scheduler.prefix_files import ENTRY, BadEntry, read_header, scope_hash
from scheduler.prefix_folder import SUBFOLDER, read_scope_salt, scope_id


class NoTraffic(ValueError):
    """Nothing could be read for the keys given (the message says why)."""


def served_identity(given: Path, target: Any) -> str:
    """The identity the server's entries in `given` carry for the loaded `target` (the
    tier's own rule, with its memo of the model files' hashes)."""
    memo = given / SUBFOLDER / MEMO
    return target_identity(target.folder, parameter_dtypes(target.model), memo)


def traffic_tokens(given: Path, identity: str, keys: tuple[str, ...]) -> list[list[int]]:
    """The token ids of the entries in `given` (a server's `--prefix-cache-dir`) made
    for the model of `identity` under `keys` (none: a keyless server's), longest of each
    conversation, longest first."""
    folder = given / SUBFOLDER
    if not folder.is_dir():
        raise NoTraffic(f"{given} holds no prefix cache of Tandem's ({SUBFOLDER} is missing)")
    if keys:
        salt = read_scope_salt(folder)
        if salt is None:
            raise NoTraffic(f"{folder} keeps no API-key salt: its server ran without keys")
        scopes = {scope_hash(scope_id(key, salt)) for key in keys}
    else:
        scopes = {scope_hash("")}
    found = []
    for path in sorted(folder.iterdir()):
        named = ENTRY.fullmatch(path.name)
        if named is None or named[1] != identity[:16]:
            continue
        try:
            header = read_header(path)
        except BadEntry:  # being written or evicted by the server: skipped
            continue
        if header.identity == identity and header.scope in scopes:
            found.append(header.tokens)
    found.sort(key=len, reverse=True)
    kept: list[list[int]] = []
    for tokens in found:
        if not any(longer[: len(tokens)] == tokens for longer in kept):
            kept.append(tokens)
    return kept
