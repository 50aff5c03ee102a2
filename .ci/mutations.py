"""Mutation check: break each safety-critical step of treestore, one at a time, and require the
tests that claim to protect it to fail.

Usage (from the repository root)::

    .venv/bin/python .ci/mutations.py            # every mutation; exit 1 if any survives
    .venv/bin/python .ci/mutations.py --list     # the table, without running anything
    .venv/bin/python .ci/mutations.py NAME ...   # only these mutations (and the clean run)

The package and the tests are copied to a temporary folder and the tests run there, so the copy
is what gets imported (each run checks it, through a small pytest plugin). Each mutation
replaces exact snippets of one file; a snippet that is not found exactly once is an error (the
code moved: update the table). The tests must pass with no mutation (the clean run: each test
once, in one copy or another), or no verdict counts. A mutation is caught when its tests fail
(pytest exit status 1); an error (collection error, timeout, the copy not imported) is reported
as such and counts as a failure of this script, like a survivor.

Two runs go at once by default (``-j``), each in a copy of its own; mutations whose tests start
processes of their own and bound them by timeouts (tests/system), or catch them by a race
(``RACES``), run afterwards, one at a time.
"""

from __future__ import annotations

import argparse
import compileall
import os
import py_compile
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT = 300  # seconds for one pytest run
PROBE_FAILED = 99  # the exit status of a run that did not import the copy


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    edits: tuple[tuple[str, str], ...]  # (exact old snippet, its replacement)
    tests: tuple[str, ...]  # pytest node ids, relative to the repository root
    why: str


def m(name: str, file: str, old: str, new: str, tests: list[str], why: str) -> Mutation:
    return Mutation(name, file, ((old, new),), tuple(tests), why)


FUZZ = "tests/attacks/test_decoder_fuzz.py"
SIZES = "tests/attacks/test_sizes.py"
ADDRESSES = "tests/attacks/test_addresses.py"
CHIP = "tests/engine/test_full_chip.py"
STAGING = "tests/engine/test_snapshot_staging.py"
LIMIT = "tests/format/test_memory_limit.py"
SHARED = "tests/system/test_shared_restore.py"
PLAN = "tests/engine/test_share_plan.py"
VOTE = "tests/engine/test_restore_vote.py"

MUTATIONS: list[Mutation] = [
    # --- commit order and put-if-absent ------------------------------------------------------
    Mutation(
        "commit order: record before manifest",
        "treestore/_engine/commit.py",
        (
            ("        storage.write(path, [manifest])\n", "        pass\n"),
            (
                "    storage.sync()\n    return decode_commit_record(",
                "    storage.write(path, [manifest])\n    storage.sync()\n    return decode_commit_record(",
            ),
        ),
        ("tests/engine/test_commit_order.py",),
        "the commit record is written before the manifest it names exists",
    ),
    m(
        "commit order: no sync before the record",
        "treestore/_engine/commit.py",
        "    storage.sync()  # the manifest before the record\n",
        "",
        ["tests/engine/test_commit_order.py::test_each_step_is_durable_before_the_next"],
        "the manifest is not made durable before the record that names it",
    ),
    m(
        "commit before every chunk has its name",
        "treestore/_engine/saving/chunk_writer.py",
        "            self.published()  # every chunk has its name before the caller commits\n",
        "",
        ["tests/engine/test_commit_order.py::test_each_step_is_durable_before_the_next"],
        "the manifest is written while chunks it references still wait for their names",
    ),
    m(
        "local chunk named before it is fsynced",
        "treestore/_storage/local.py",
        "                _fsync(self._tmp)\n",
        "",
        ["tests/format/test_chunk_objects.py::test_a_local_chunk_is_fsynced_before_it_takes_its_name"],
        "after a power cut a chunk's name can hold a short or empty file",
    ),
    m(
        "a new local folder's name left to chance",
        "treestore/_storage/local.py",
        '            self._dirty_dirs.add(os.path.dirname(folder) or ".")\n',
        "            pass\n",
        ["tests/engine/test_commit_order.py::test_a_new_folder_is_durable_in_its_parent_before_the_record"],
        "after a power cut a new chunk folder, and every chunk in it, can be gone under a commit",
    ),
    m(
        "an existing local folder taken as made",
        "treestore/_storage/local.py",
        "        except FileExistsError:\n            return False\n        except FileNotFoundError:\n",
        "        except FileExistsError:\n            return True\n        except FileNotFoundError:\n",
        ["tests/storage/test_local_syscalls.py::test_a_save_asks_nothing_about_chunks_in_folders_it_made"],
        "a save into a store in use writes every chunk again instead of reusing it",
    ),
    m(
        "a failed save keeps its staged chunks",
        "treestore/_engine/saving/chunk_writer.py",
        "                    chunk.discard()\n",
        "                    pass\n",
        [
            "tests/engine/test_commit_order.py"
            "::test_a_save_that_fails_while_chunks_wait_for_their_names_leaves_nothing"
        ],
        "temporary files of a failed save are left in the store",
    ),
    m(
        "the caller's own array read in place",
        "treestore/_tree/leaves.py",
        "    return ArrayLeaf(NUMPY, name, data, None, (), None, False, data is not value)\n",
        "    return ArrayLeaf(NUMPY, name, data, None, (), None, False, True)\n",
        [
            "tests/tree/test_private_leaves.py::test_which_leaves_a_save_may_read_in_place",
            "tests/format/test_chunk_objects.py::test_an_array_written_to_during_a_save_never_makes_a_damaged_chunk",
        ],
        "an array the caller changes during a save is hashed and encoded from different bytes",
    ),
    m(
        "a reopened manifest not read again",
        "treestore/_engine/reading/committed.py",
        "    data = data if data is not None else read_manifest_bytes(storage, record)\n"
        "    found = _decoded.get(record.manifest)\n",
        "    found = _decoded.get(record.manifest)\n"
        "    data = data if data is not None or found is not None else "
        "read_manifest_bytes(storage, record)\n",
        [
            "tests/engine/test_integrity.py::test_a_manifest_damaged_after_it_was_opened_is_refused_when_reopened"
        ],
        "a manifest damaged after a first open goes unnoticed by every later open and load",
    ),
    m(
        "memory put-if-absent without its lock",
        "treestore/_storage/local.py",
        "        with self._lock:\n            if self.exists(path):",
        "        if True:\n            if self.exists(path):",
        ["tests/storage/test_put_if_absent.py"],
        "check-then-write: two racing writers of one name both succeed",
    ),
    m(
        "local put-if-absent by replace",
        "treestore/_storage/local.py",
        "os.link(tmp, full)",
        "os.replace(tmp, full)",
        ["tests/storage/test_put_if_absent.py"],
        "a commit record of another writer is overwritten",
    ),
    m(
        "local listing follows a symlinked folder",
        "treestore/_storage/local.py",
        "            return []\n        self._check_inside(top)\n",
        "            return []\n",
        [
            "tests/attacks/test_filesystem.py"
            "::test_a_symlinked_object_folder_is_refused_and_gc_deletes_nothing_through_it"
        ],
        "a listing (and gc) reaches through chunks/ symlinked to a folder outside the store",
    ),
    # --- digest checks -------------------------------------------------------------------------
    m(
        "chunk digest check removed",
        "treestore/_engine/reading/read.py",
        "if check and digest(out) != c.digest:",
        "if False:",
        [f"{FUZZ}::test_real_chunk_with_bytes_changed"],
        "a chunk whose bytes changed is returned unverified",
    ),
    m(
        "pack slice digest check removed",
        "treestore/_engine/reading/read.py",
        "return part if part.nbytes == size and digest(part) == chunk_digest else None",
        "return part",
        [
            "tests/attacks/test_foreign_chunks.py::test_packed_leaf_pointing_at_its_neighbours_bytes",
            "tests/engine/test_integrity.py::test_pack_member_whose_digest_lies",
        ],
        "a packed leaf reads its neighbour's bytes",
    ),
    m(
        "manifest digest check removed",
        "treestore/_engine/reading/committed.py",
        "if len(data) != record.manifest_size or digest(data) != record.manifest:",
        "if len(data) != record.manifest_size:",
        ["tests/attacks/test_foreign_chunks.py::test_manifest_object_rewritten_in_place"],
        "a manifest rewritten in place is read as the checkpoint's",
    ),
    m(
        "commit record check digest ignored",
        "treestore/_format/commit_record.py",
        'if _get(rec, "check", bytes) != _record_check(record):',
        'if not isinstance(_get(rec, "check", bytes), bytes):',
        ["tests/attacks/test_fields.py::test_commit_record_changed_without_its_check"],
        "a listing shows a commit record whose fields were changed",
    ),
    # --- gc: reachability and containment ------------------------------------------------------
    m(
        "gc treats no chunk as live",
        "treestore/_engine/gc.py",
        "or digest in live_chunks:",
        "or False:",
        [f"{FUZZ}::test_gc_with_lock_objects_of_arbitrary_content", "tests/engine/test_commit_order.py"],
        "gc deletes the chunks of committed checkpoints",
    ),
    m(
        "gc treats no manifest as live",
        "treestore/_engine/gc.py",
        "or found in live_manifests",
        "or False",
        [f"{FUZZ}::test_gc_with_lock_objects_of_arbitrary_content", "tests/engine/test_commit_order.py"],
        "gc deletes the manifests of committed checkpoints",
    ),
    m(
        "gc chunk names loosened",
        "treestore/_format/paths.py",
        r'_CHUNK = re.compile(r"chunks/([0-9a-f]{2})/(\1[0-9a-f]{62})")',
        r'_CHUNK = re.compile(r"chunks/([0-9a-f]{2})/([0-9a-f]{64})")',
        [f"{FUZZ}::test_gc_with_lock_objects_of_arbitrary_content"],
        "gc deletes an object named like a chunk in another chunk's folder",
    ),
    m(
        "gc forgets the parts of a manifest stored in parts",
        "treestore/_engine/gc.py",
        "                live_manifests.update(columns.parts)",
        "                pass",
        ["tests/format/test_parts_merge.py::test_gc_keeps_the_parts_of_a_checkpoint_until_it_is_deleted"],
        "gc deletes the parts of a committed multi-process checkpoint, which no reader can then read",
    ),
    # --- multi-process commits -----------------------------------------------------------------
    m(
        "commit skips the coverage check",
        "treestore/_engine/group/distributed.py",
        "                if cover != expected or empty:",
        "                if empty:",
        ["tests/format/test_parts_merge.py::test_pieces_that_do_not_tile_a_leaf_name_it_and_the_processes"],
        "a multi-process save commits pieces that overlap or leave a gap: readers refuse the checkpoint",
    ),
    m(
        "readers skip the leaf range of a part",
        "treestore/_format/parts/merge.py",
        '    refuse(outside, process, "a piece lies outside the leaves its frame lists")',
        "    pass",
        ["tests/format/test_parts_merge.py::test_a_frame_that_lists_a_part_s_leaves_wrongly_is_refused"],
        "a reader of every leaf accepts a checkpoint that readers of some of its leaves refuse",
    ),
    m(
        "a part is not checked against its digest",
        "treestore/_engine/reading/parts.py",
        "    if len(data) != size or digest(data) != found:",
        "    if False:",
        ["tests/format/test_parts_merge.py::test_a_part_missing_or_changed_is_refused_by_readers"],
        "a reader takes a changed part's pieces",
    ),
    # --- restores that share replicated bytes between processes --------------------------------
    m(
        "restore: nothing shared",
        "treestore/_engine/reading/share_plan.py",
        "    if not replicated:\n        return None\n",
        "    if True:\n        return None\n",
        [f"{SHARED}::test_two_processes_read_each_replicated_byte_once[host]"],
        "every process reads every replicated byte from the store: N times the checkpoint at N processes",
    ),
    m(
        "restore: one replica reads everything",
        "treestore/_engine/reading/share_plan.py",
        "        r = min(range(replicas), key=lambda i: (load[i], i))",
        "        r = 0",
        [f"{PLAN}::test_the_readers_are_spread_evenly_over_the_replicas"],
        "one device, one process, reads the whole checkpoint while the others wait for it",
    ),
    m(
        "restore: leaves of one pack read by several readers",
        "treestore/_engine/reading/share_plan.py",
        "            if u is not None and u not in joins and held + sizes[u] <= room(o):",
        "            if False:",
        [f"{PLAN}::test_small_leaves_in_one_pack_get_one_reader"],
        "a pack of small leaves is read once per reader of one of its leaves, not once",
    ),
    m(
        "restore: a big leaf split mid-chunk",
        "treestore/_engine/reading/share_plan.py",
        "        best = min(clean.tolist(), key=lambda x: (abs(x - target), x), default=None)",
        "        best = round(target)",
        [f"{PLAN}::test_a_leaf_is_not_split_where_no_chunk_boundary_falls_between_its_rows"],
        "two processes each read the chunk their parts of a leaf share: the store serves it twice",
    ),
    m(
        "restore: a pack's leaves split by a reader's share",
        "treestore/_engine/reading/share_plan.py",
        '        return max(most, int(columns.packs["raw"][o[1]])) if o[0] == "pack" else most',
        "        return most",
        [f"{PLAN}::test_the_leaves_of_one_pack_stay_one_unit_past_a_readers_share"],
        "the biases' own batch goes to every reader, each reading their pack",
    ),
    m(
        "restore: a leaf cut inside a pack",
        "treestore/_engine/reading/share_plan.py",
        "        clean = clean[~inside]",
        "        pass",
        [
            f"{PLAN}::test_a_leaf_in_several_packs_is_cut_where_one_pack_ends",
            f"{PLAN}::test_a_leaf_whose_pieces_share_a_pack_is_read_whole",
        ],
        "a leaf's parts end inside a pack: each of their readers reads the pack",
    ),
    m(
        "restore: a leaf's parts laid over each other on the host",
        "treestore/_engine/reading/share.py",
        "            into = out[part.start : part.start + part.region_bytes]",
        "            into = out[: part.region_bytes]",
        [f"{SHARED}::test_four_processes_read_each_replicated_byte_once[host]"],
        "on CPU devices every part of a split leaf is copied to the leaf's first rows",
    ),
    m(
        "restore: a chunk two regions meet fetched twice",
        "treestore/_engine/reading/region.py",
        "    reader.expect({d: n for d, n in uses.items() if n > 1})",
        "    pass",
        ["tests/engine/test_region.py::test_a_chunk_two_regions_meet_is_fetched_once"],
        "a process restoring a leaf saved whole onto two of its devices reads its chunk twice",
    ),
    m(
        "restore: no vote before the collective",
        "treestore/_engine/reading/share.py",
        "        agreement.agree(batch_token(token, batch))\n",
        "",
        [f"{SHARED}::test_two_processes_read_each_replicated_byte_once[host]"],
        "a process whose read failed leaves the others in the collective until the timeout",
    ),
    m(
        "restore: a failing process does not vote",
        "treestore/_engine/group/restore_vote.py",
        "            vote.fail(exc)\n",
        "            pass\n",
        [f"{VOTE}::test_a_process_that_fails_makes_every_process_raise_its_class"],
        "the other processes wait for the failed one until the barrier timeout",
    ),
    m(
        "restore: no last vote",
        "treestore/_engine/group/restore_vote.py",
        '    vote.agree("done")',
        "    pass",
        [f"{VOTE}::test_a_failure_after_the_last_collective_makes_every_process_raise"],
        "processes return a tree another process failed to make",
    ),
    m(
        "restore: plans not compared",
        "treestore/_engine/group/restore_vote.py",
        "        if len(tokens) > 1:",
        "        if False:",
        [f"{VOTE}::test_processes_sharing_different_things_all_raise"],
        "processes restoring different checkpoints or shardings share each other's bytes",
    ),
    m(
        "restore: a dead process waited for without end",
        "treestore/_engine/group/restore_vote.py",
        "        why = self.runtime.wait(root, self.timeout)",
        "        why = self.runtime.wait(root, 3600.0)",
        [f"{SHARED}::test_a_process_killed_mid_restore_makes_every_survivor_raise[reading]"],
        "the survivors of a process killed mid-restore hang",
    ),
    m(
        "restore: the collective not bounded",
        "treestore/_engine/reading/share.py",
        "    thread.join(timeout)",
        "    thread.join()",
        [f"{SHARED}::test_a_process_killed_mid_restore_makes_every_survivor_raise[sharing]"],
        "the survivors of a process that dies as the collective starts hang in it",
    ),
    m(
        "restore: shared bytes taken back big-endian",
        "treestore/_engine/reading/share.py",
        "        return jax.lax.bitcast_convert_type(raw.reshape((*shape, dtype.itemsize)), dtype)",
        "        return jax.lax.bitcast_convert_type(raw.reshape((*shape, -1))[..., ::-1], dtype)",
        [f"{SHARED}::test_two_processes_read_each_replicated_byte_once[device]"],
        "the bytes of a wide dtype are put together in the wrong order: every value changes",
    ),
    m(
        "restore: a leaf cut from another reader's segment",
        "treestore/_engine/reading/share.py",
        "            start = np.array([[s.reader, s.offset // ALIGN] for s in parts], np.int32)",
        "            start = np.array([[0, s.offset // ALIGN] for s in parts], np.int32)",
        [f"{SHARED}::test_four_processes_read_each_replicated_byte_once[device]"],
        "the devices take a leaf's bytes from replica 0's segment, whoever read it",
    ),
    m(
        "restore: a leaf cut on the host from another reader's segment",
        "treestore/_engine/reading/share.py",
        "            raw = held[part.reader, part.offset : part.offset + part.region_bytes]",
        "            raw = held[0, part.offset : part.offset + part.region_bytes]",
        [f"{SHARED}::test_four_processes_read_each_replicated_byte_once[host]"],
        "on CPU devices a leaf's bytes come from replica 0's segment, whoever read it",
    ),
    # --- structure validation ------------------------------------------------------------------
    m(
        "leaf not checked to sit at its address",
        "treestore/_format/manifest/v1.py",
        "            if stored != placed:",
        "            if False:",
        [f"{ADDRESSES}::test_two_leaves_with_swapped_addresses"],
        "a leaf entry names another leaf's tree position",
    ),
    m(
        "record not checked to be a map",
        "treestore/_format/encoding.py",
        "if not isinstance(obj, dict):",
        "if False:",
        [f"{FUZZ}::test_decode_manifest_of_arbitrary_bytes", f"{FUZZ}::test_decode_ref_of_arbitrary_bytes"],
        "an AttributeError escapes the envelope check of a record that is not a map",
    ),
    m(
        "leaf entry not checked to be a map",
        "treestore/_format/manifest/v1.py",
        '    if not isinstance(rec, dict):\n        raise _Bad("leaf entry is not a map")',
        '    if False:\n        raise _Bad("leaf entry is not a map")',
        [f"{FUZZ}::test_manifest_with_one_field_replaced", f"{FUZZ}::test_decoders_of_arbitrary_msgpack"],
        "a TypeError escapes the manifest decoder (the fuzzers reach past the envelope)",
    ),
    Mutation(
        "key index range checks removed",
        "treestore/_format/address.py",
        (
            (
                'if kind == "seq" and type(value) is int and 0 <= value < MAX_INDEX:',
                'if kind == "seq" and type(value) is int:',
            ),
            (
                "if isinstance(key, SequenceKey) and type(key.idx) is int and 0 <= key.idx < MAX_INDEX:",
                "if isinstance(key, SequenceKey) and type(key.idx) is int:",
            ),
        ),
        (f"{ADDRESSES}::test_key_records_with_indices_beyond_32_bits",),
        "a key index beyond 32 bits is decoded (key record) and formatted (segment) unchecked",
    ),
    # --- address canonicality ------------------------------------------------------------------
    m(
        "canonical_segment accepts any parsable segment",
        "treestore/_format/address.py",
        "if format_key(key) != segment:",
        "if False:",
        ["tests/format/test_address.py"],
        'a manifest may spell a key in another form ("py" for py)',
    ),
    m(
        "parser accepts {-0}",
        "treestore/_format/address.py",
        'if _INT.match(inner) and inner != "-0" and',
        "if _INT.match(inner) and",
        ["tests/format/test_address.py::test_malformed_addresses_are_rejected"],
        "two texts parse to one key (parsing is no longer injective)",
    ),
    m(
        "parser accepts lowercase escapes",
        "treestore/_format/address.py",
        'all(c in "0123456789ABCDEF" for c in digits)',
        'all(c in "0123456789ABCDEFabcdef" for c in digits)',
        ["tests/format/test_address.py::test_malformed_addresses_are_rejected"],
        "%2f and %2F both parse to /",
    ),
    # --- size bounds ---------------------------------------------------------------------------
    m(
        "MAX_GRID_CELLS check removed",
        "treestore/_format/manifest/rules.py",
        "if cells > MAX_GRID_CELLS:",
        "if False:",
        [f"{SIZES}::test_pieces_whose_boundaries_span_too_large_a_grid"],
        "the cover count of a piece grid is unbounded",
    ),
    m(
        "CHUNK_SLACK check removed",
        "treestore/_engine/reading/read.py",
        "if n > c.raw_size + CHUNK_SLACK:",
        "if False:",
        [f"{SIZES}::test_chunk_object_larger_than_its_raw_size_allows"],
        "a chunk object larger than its raw size allows is accepted",
    ),
    m(
        "MAX_MANIFEST_BYTES check removed",
        "treestore/_format/commit_record.py",
        '_count(rec.get("manifest_size"), "manifest_size", MAX_MANIFEST_BYTES)',
        '_count(rec.get("manifest_size"), "manifest_size")',
        [f"{SIZES}::test_commit_record_declaring_a_manifest_over_the_bound"],
        "a commit record may declare a manifest beyond the bound",
    ),
    # --- templates and snapshots ---------------------------------------------------------------
    m(
        "like= returns the template's arrays",
        "treestore/_tree/template.py",
        "    if isinstance(like, np.ndarray):\n        return restore_array(NUMPY, data, None)",
        "    if isinstance(like, np.ndarray):\n        return like",
        ["tests/tree/test_template.py"],
        "a load with a template hands back the template's leaves",
    ),
    m(
        "async save reuses no host copy",
        "treestore/_engine/saving/snapshot.py",
        "                and not value.is_deleted()\n",
        "                and False\n",
        ["tests/api/test_manager.py::test_unchanged_jax_arrays_are_reused_and_changed_ones_copied"],
        "an unchanged jax array is copied to host again at every save",
    ),
    m(
        "chunk reuse trusts any object of the right name",
        "treestore/_format/codecs.py",
        "    if not HEADER.size < stored <= raw_size + CHUNK_SLACK or len(head) < min(stored, PROBE_BYTES):\n"
        "        return False\n",
        "    return True\n",
        [
            "tests/format/test_chunk_objects.py",
            "tests/format/test_chunk_objects.py::test_a_save_does_not_reuse_a_bad_chunk_object",
        ],
        "a save references a damaged or empty object left under a chunk's name",
    ),
    m(
        "hash one buffer, encode another",
        "treestore/_engine/saving/chunk_writer.py",
        "    np.copyto(out, raw)\n    return out\n",
        "    return raw\n",
        [
            "tests/format/test_chunk_objects.py::test_an_array_written_to_during_a_save_never_makes_a_damaged_chunk"
        ],
        "an array changed during a save is hashed and encoded from different bytes",
    ),
    # --- results of a load -------------------------------------------------------------------
    m(
        "loaded leaves may alias",
        "treestore/_engine/reading/load_leaves.py",
        "part.copy() if shared[j] else part",
        "part",
        [
            "tests/engine/test_integrity.py::test_leaves_naming_the_same_packed_bytes_load_as_separate_arrays",
        ],
        "two leaves naming one pack member load as views of one buffer",
    ),
    # --- two tiers ---------------------------------------------------------------------------
    m(
        "tiers compared as strings",
        "treestore/_api/manager/replication.py",
        "if remote._storage.overlaps(local._storage):",
        "if remote.url == local.url:",
        ["tests/api/test_two_tier.py::test_one_store_as_both_tiers_is_refused_however_it_is_spelt"],
        "one folder spelt two ways is accepted as both tiers, whose retentions delete each other's steps",
    ),
    m(
        "local location without resolving links",
        "treestore/_storage/local.py",
        'os.path.realpath(self.root or ".")',
        'os.path.normpath(self.root or ".")',
        ["tests/api/test_two_tier.py::test_one_store_as_both_tiers_is_refused_however_it_is_spelt"],
        "a symlinked spelling of the local tier is taken for another store",
    ),
    m(
        "BLAKE3 runs without kept room",
        "treestore/_kernels/digest.py",
        "    if not _is_limited:",
        "    if True:",
        ["tests/engine/test_threads.py::test_blake3_keeps_room_under_an_address_space_limit"],
        "under an address-space limit BLAKE3's own allocations meet the limit first and abort",
    ),
    # --- copy ----------------------------------------------------------------------------------
    m(
        "copy and verify trust pack members",
        "treestore/_engine/reading/scan.py",
        "            sound = checked[d, offset, size] = pack_member(raw, offset, size, d) is not None",
        "            sound = checked[d, offset, size] = True",
        [
            "tests/api/test_transfer.py::test_a_packed_leaf_a_load_refuses_is_not_copied",
            "tests/format/test_parts_merge.py::test_a_packed_piece_a_load_refuses_is_not_copied",
            "tests/api/test_verify.py::test_pack_slice_that_does_not_match_its_leaf",
        ],
        "copy commits, and verify calls sound, a packed leaf whose reference into its pack a load refuses",
    ),
    # --- bounded work on hostile manifests --------------------------------------------------
    m(
        "tiling counts every cell of every piece",
        "treestore/_format/manifest/rules.py",
        "    if int(np.prod(np.subtract(hi, lo), axis=1).sum()) != cells:\n",
        "    if False:\n",
        [
            "tests/attacks/test_sizes.py::"
            "test_overlapping_pieces_over_a_fine_grid_are_refused_without_counting_every_cell"
        ],
        "overlapping pieces over a fine grid cost pieces x cells to refuse (minutes)",
    ),
    m(
        "addresses unbounded",
        "treestore/_format/manifest/tree.py",
        "    _check_address_lengths(segments, parent, key)\n",
        "",
        [ADDRESSES + "::test_a_deep_chain_of_long_keys_is_refused_before_its_addresses_are_built"],
        "a few KiB of manifest names gigabytes of addresses, built by every reader",
    ),
    m(
        "version-1 leaves decoded to the last byte",
        "treestore/_format/manifest/v1.py",
        "            if i % ROOM_EVERY == 0:\n"
        "                check_room()  # stop while running out can still be reported\n",
        "",
        [f"{LIMIT}::test_a_manifest_of_many_leaves_decodes_or_runs_out_promptly_with_room_left[v1]"],
        "a version-1 manifest of many leaves under an address-space limit runs the process to its last "
        "bytes, where CPython can spin forever unwinding the MemoryError",
    ),
    m(
        "node segments checked to the last byte",
        "treestore/_format/manifest/tree.py",
        "    for i, segment in enumerate(segments):\n        if i % ROOM_EVERY == 0:\n"
        "            check_room()",
        "    for i, segment in enumerate(segments):\n        if False:\n            check_room()",
        [f"{LIMIT}::test_a_manifest_of_many_leaves_decodes_or_runs_out_promptly_with_room_left[v2]"],
        "the segments of a manifest of many nodes, either version, run the process to its last bytes "
        "under an address-space limit, where CPython can spin forever unwinding the MemoryError",
    ),
    m(
        "repair trusts the source copy unchecked",
        "treestore/_api/verify.py",
        "        data, _ = fetch_chunk(source, ref)\n",
        "        from treestore._format import paths as _layout\n"
        "        data = source.read(_layout.chunk_path(ref.digest))\n"
        "        if data is None:\n            return False\n",
        ["tests/api/test_verify.py::test_a_repair_source_without_an_intact_copy_repairs_nothing"],
        "verify --repair-from writes a source object without checking it against its digest",
    ),
    # --- health and exports (round 4) ---------------------------------------------------------
    m(
        "-inf is not unhealthy",
        "treestore/_api/health.py",
        '(table["nan"] | table["posinf"] | table["neginf"]) > 0',
        '(table["nan"] | table["posinf"]) > 0',
        ["tests/api/test_health_retention.py::test_negative_infinity_alone_makes_a_step_unhealthy"],
        "a step holding -inf counts as healthy, and retention deletes the finite step before it",
    ),
    m(
        "a healthy= check overrides recorded NaN",
        "treestore/_api/manager/retention.py",
        "        if state is False or check is None:\n",
        "        if check is None:\n",
        [
            "tests/api/test_health_retention.py::test_a_check_that_accepts_everything_cannot_override_recorded_nan"
        ],
        "a caller's check that accepts everything makes a NaN step the one restore(healthy=True) loads",
    ),
    m(
        "unknown health taken for healthy",
        "treestore/_api/manager/retention.py",
        "        if state is True:\n",
        "        if state is not False:\n",
        [
            "tests/api/test_health_retention.py::test_an_unknown_newer_step_does_not_take_the_healthy_steps_protection"
        ],
        "a step saved without statistics takes the last healthy step's protection, which is deleted",
    ),
    m(
        "retention protects no step of unknown health",
        "treestore/_api/manager/retention.py",
        "    found = maybe if known is None else known\n",
        "    found = known\n",
        [
            "tests/api/test_health_retention.py::test_with_no_step_known_healthy_the_newest_not_known_unhealthy_is_kept",
            "tests/api/test_two_tier.py::test_each_tier_keeps_its_newest_step_not_known_unhealthy_when_none_is_known_healthy",
        ],
        "with no step known healthy, keep_last deletes the one step never shown unhealthy: nothing to resume",
    ),
    m(
        "retention protects the oldest step of unknown health",
        "treestore/_api/manager/retention.py",
        "        if state is None and maybe is None:\n",
        "        if state is None:\n",
        [
            "tests/api/test_health_retention.py::test_a_step_known_healthy_takes_the_protection_from_older_and_newer_unknown_ones"
        ],
        "with no step known healthy, retention keeps the oldest step of unknown health, not the newest",
    ),
    m(
        "export temporaries through links",
        "treestore/_api/interop/temporary.py",
        'os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)',
        "os.O_WRONLY | os.O_CREAT | os.O_TRUNC",
        ["tests/api/test_hf_shards.py::test_export_does_not_follow_links_planted_at_temporary_names"],
        "an export writes shard bytes through a link planted at its temporary name, outside the folder",
    ),
    m(
        "commit trusts the object under its manifest's name",
        "treestore/_engine/commit.py",
        "    if storage.read_range(path, 0, len(manifest) + 1) != manifest:",
        "    if storage.read_range(path, 0, 1) is None:",
        [
            "tests/engine/test_commit_order.py::test_a_commit_replaces_a_damaged_object_under_its_manifests_name"
        ],
        "a copy over a damaged object of the same name commits a checkpoint that does not load",
    ),
    m(
        "gc ages objects without a modification time",
        "treestore/_engine/gc.py",
        "        return mtime is not None and now - mtime >= limit\n",
        "        return mtime is None or now - mtime >= limit\n",
        ["tests/engine/test_gc_age.py"],
        "gc deletes objects of a backend that reports no mtime, which may belong to a save in flight",
    ),
    m(
        "lazy reads skip the digest",
        "treestore/_engine/reading/read.py",
        "        self._decode(self._object(c, address, room), c, out, address, room)\n",
        "        self._decode(self._object(c, address, room), c, out, address, room, check=False)\n",
        ["tests/engine/test_integrity.py::test_a_chunk_that_decodes_to_other_bytes_fails_every_lazy_read"],
        "a slice of a leaf returns other bytes silently when a chunk object was replaced",
    ),
    m(
        "addresses unbounded together",
        "treestore/_format/manifest/tree.py",
        "    if int(length.sum()) > MAX_ADDRESSES_CHARS:\n",
        "    if False:\n",
        [ADDRESSES + "::test_many_leaves_under_one_long_key_are_refused_by_their_addresses_together"],
        "a manifest under 1 MiB names hundreds of MiB of addresses, built by every reader",
    ),
    Mutation(
        "a save looks for gc before announcing itself",
        "treestore/_engine/locks.py",
        (
            ('    lock = Lock(storage, "save")\n', ""),
            (
                "        delay = min(delay * 2, 1.0)\n    return lock\n",
                '        delay = min(delay * 2, 1.0)\n    return Lock(storage, "save")\n',
            ),
        ),
        ("tests/engine/test_locks.py::test_a_save_announces_itself_before_it_looks_for_a_gc",),
        "a gc that starts while a save looks for gc locks deletes the chunks that save writes",
    ),
    m(
        "a write learns its trusted chunks before taking the save lock",
        "treestore/_engine/saving/writing.py",
        "        lock = _locks.save_lock(self.storage)\n        try:\n"
        "            trusted = _trusted.learn(self.storage, previous)",
        "        trusted = _trusted.learn(self.storage, previous)\n"
        "        lock = _locks.save_lock(self.storage)\n        try:\n            pass",
        ["tests/engine/test_trusted_chunks.py::test_a_save_never_trusts_chunks_gc_deleted_while_it_waited"],
        "a save trusts the chunks of a checkpoint a gc deletes while the save waits for it: its "
        "manifest names deleted chunks",
    ),
    m(
        "a gc looks for saves before announcing itself",
        "treestore/_engine/locks.py",
        '        lock = Lock(storage, "gc")\n        saves = live_locks(storage, "save", stale_after)\n',
        '        saves = live_locks(storage, "save", stale_after)\n        lock = Lock(storage, "gc")\n',
        ["tests/engine/test_locks.py::test_a_gc_announces_itself_before_it_looks_for_saves"],
        "a save that starts while a gc looks for save locks writes chunks that gc deletes",
    ),
    m(
        "two-piece leaves skip the tiling check",
        "treestore/_format/manifest/check.py",
        "        if counts[r] > 1:\n",
        "        if counts[r] > 2:\n",
        [SIZES + "::test_two_pieces_that_overlap_and_leave_a_hole_are_refused"],
        "a leaf of two overlapping pieces loads uninitialised memory and verify calls it sound",
    ),
    m(
        "complex leaves unmeasured",
        "treestore/_format/stats.py",
        "    | dict.fromkeys(_PARTS, COMPLEX)\n",
        "",
        ["tests/api/test_health_retention.py::test_a_complex_leaf_holding_nan_is_never_healthy"],
        "a NaN in a complex leaf leaves health unknown, and retention may drop the good step",
    ),
    m(
        "compiled statistics trust a sum over NaN",
        "treestore/_format/stats.py",
        "        if math.isfinite(total):\n",
        "        if True:\n",
        [
            "tests/engine/test_stats.py::test_a_chunk_of_several_spans_is_measured_exactly",
            "tests/engine/test_stats.py::test_the_compiled_and_the_numpy_statistics_are_the_same_record",
        ],
        "a float32 chunk holding NaN is recorded as finite: healthy, and retention keeps the wrong step",
    ),
    # --- the device path on a full chip (tests/engine/test_full_chip.py) ---------------------------
    m(
        "device room read between steps, not at the peak",
        "treestore/_engine/saving/device_memory.py",
        'used = max(int(memory.get("peak_bytes_in_use", 0)), int(memory.get("bytes_in_use", 0)))',
        'used = int(memory.get("bytes_in_use", 0))',
        [
            f"{CHIP}::test_an_async_snapshot_is_copied_on_the_device_only_beside_the_step_s_peak",
            f"{CHIP}::test_a_device_without_room_for_slices_beside_the_step_s_peak_gets_none",
        ],
        "an async snapshot's device copy takes memory the next step needs",
    ),
    m(
        "device room blind to a TPU's reserved program temporaries",
        "treestore/_engine/saving/device_memory.py",
        'return int(memory["bytes_limit"]) - used - reserved',
        'return int(memory["bytes_limit"]) - used',
        [f"{CHIP}::test_a_step_s_reserved_temporaries_leave_no_room_for_a_device_snapshot"],
        "a device snapshot beside the step's buffers leaves no room to load the step's program",
    ),
    m(
        "device snapshot without the device-room rule",
        "treestore/_engine/saving/snapshot.py",
        "if on_device is not None and device_room(values, on_device, device_limit, window):",
        "if on_device is not None:",
        [f"{CHIP}::test_an_async_snapshot_is_copied_on_the_device_only_beside_the_step_s_peak"],
        "the device copy is made whatever the device's room",
    ),
    m(
        "device snapshot leaves no room for the slices",
        "treestore/_engine/saving/snapshot.py",
        "return device_memory.fits(need, window)",
        "return device_memory.fits(need)",
        [f"{CHIP}::test_an_async_snapshot_is_copied_on_the_device_only_beside_the_step_s_peak"],
        "the copy fits, but the slices the save cuts from it do not",
    ),
    m(
        "slices cut on a device without room",
        "treestore/_engine/saving/device_fetch.py",
        "target = self.target if self.may_slice(leaf.array) else leaf.nbytes",
        "target = self.target",
        [f"{CHIP}::test_a_device_without_room_for_slices_beside_the_step_s_peak_gets_none"],
        "slices in flight take device memory the step needs",
    ),
    m(
        "leaf moved whole keeps its host copy on the caller's array",
        "treestore/_engine/saving/device_fetch.py",
        "    fresh.copy_to_host_async()\n    return fresh",
        "    x.copy_to_host_async()\n    return x",
        [f"{CHIP}::test_a_leaf_moved_whole_goes_through_a_new_array_over_the_same_device_buffers"],
        "a sync save leaves the host bytes of every leaf it moved whole on the caller's tree",
    ),
    m(
        "host window unbounded",
        "treestore/_engine/saving/device_fetch.py",
        "if self.held and self.held + nbytes > self.limit:",
        "if False:",
        ["tests/engine/test_device_path.py::test_the_host_window_bounds_the_bytes_in_flight"],
        "device transfers run ahead of the writes without bound: the tree in host memory",
    ),
    m(
        "slicing program out of memory fails the save",
        "treestore/_engine/saving/device_fetch.py",
        "            except jax.errors.JaxRuntimeError:\n                self._room",
        "            except ZeroDivisionError:\n                self._room",
        [f"{CHIP}::test_a_slicing_program_out_of_memory_falls_back_to_whole_leaves"],
        "a save fails for want of device memory instead of fetching leaves whole",
    ),
    m(
        "failed transfer raised as jax's error",
        "treestore/_engine/saving/device_fetch.py",
        "    except jax.errors.JaxRuntimeError as error:\n        raise DeviceError(",
        "    except ZeroDivisionError as error:\n        raise DeviceError(",
        [f"{CHIP}::test_a_failed_transfer_raises_a_device_error_and_commits_nothing"],
        "a failed transfer is not a TreestoreError and names no leaf",
    ),
    m(
        "device copy out of memory fails the save",
        "treestore/_engine/saving/snapshot.py",
        "except jax.errors.JaxRuntimeError:  # no device memory",
        "except ZeroDivisionError:  # no device memory",
        [f"{CHIP}::test_a_device_copy_that_fails_falls_back_to_a_host_snapshot"],
        "an async save fails for want of device memory instead of staging on the host",
    ),
    m(
        "staged chunks left on the caller's buffer",
        "treestore/_engine/saving/staging.py",
        "chunks = [c.copy() if any(",
        "chunks = [c if any(",
        [f"{STAGING}::test_a_leaf_the_fetcher_moves_whole_is_copied_out_of_the_caller_s_buffer"],
        "a CPU snapshot aliases the arrays the caller donates to its next step",
    ),
    m(
        "snapshot staged through the fetcher on a device without room",
        "treestore/_engine/saving/staging.py",
        "        return self._fetcher.may_slice(x)\n",
        "        return True\n",
        [f"{STAGING}::test_a_device_without_room_for_a_window_of_slices_is_not_staged"],
        "a snapshot with no room for slices moves its leaves one at a time, not all at once",
    ),
    m(
        "staged chunks stored at another chunk size",
        "treestore/_engine/saving/chunking.py",
        "        if data.step == step:\n",
        "        if True:\n",
        [f"{STAGING}::test_chunks_staged_for_another_chunk_size_are_cut_again"],
        "a save stores chunks of the snapshot's size, not its own: other objects, lost dedup",
    ),
    m(
        "background that cannot start keeps the device copies",
        "treestore/_api/manager/save_queue.py",
        "            job()\n            return\n",
        "            raise\n",
        [f"{CHIP}::test_a_background_that_cannot_start_writes_at_once_and_frees_the_device_copies"],
        "the device copies stay alive until the next save, and the save is lost",
    ),
    m(
        "jax's host copies held across snapshots",
        "treestore/_engine/saving/snapshot.py",
        "                del kept[address]  # jax's host copy",
        "                pass  # jax's host copy",
        [f"{CHIP}::test_an_async_snapshot_drops_jax_s_host_copies_before_the_next_one"],
        "an async save holds two trees in host memory",
    ),
    m(
        "device leaves measured apart",
        "treestore/_engine/saving/chunking.py",
        "lambda raw: submit(raw, width, True, dtype), address)",
        "lambda raw: submit(raw, width, True, None), address)",
        [f"{CHIP}::test_one_tree_gets_one_record_on_the_device_path_the_host_path_and_an_async_snapshot"],
        "a leaf fetched from a device gets another record than the same bytes from the host",
    ),
]

PROBE = """\
import os

import pytest


def pytest_sessionstart(session):
    import treestore

    root = os.environ["MUTATION_ROOT"]
    if not os.path.realpath(treestore.__file__).startswith(os.path.realpath(root) + os.sep):
        pytest.exit(f"imported {treestore.__file__}, not the copy in {root}", returncode=99)
"""


def copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")
    shutil.copytree(ROOT / "treestore", dest / "treestore", ignore=ignore)
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    (dest / "_mutation_probe.py").write_text(PROBE)
    # Compiled once, checked against their source's hash at each import: a run compiles only the
    # file its mutation changed (the runs write no bytecode), not every module it imports.
    for folder in ("treestore", "tests"):
        compileall.compile_dir(
            dest / folder, quiet=1, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH
        )


def apply(dest: Path, mutation: Mutation) -> str | None:
    """Apply ``mutation`` to the copy; the problem, if a snippet is not found exactly once."""
    path = dest / mutation.file
    text = path.read_text()
    for old, new in mutation.edits:
        found = text.count(old)
        if found != 1:
            return f"snippet found {found} times in {mutation.file}: {old.strip()[:60]!r}"
        text = text.replace(old, new)
    path.write_text(text)
    return None


def restore(dest: Path, mutation: Mutation) -> None:
    shutil.copy2(ROOT / mutation.file, dest / mutation.file)


def run_tests(dest: Path, tests: list[str]) -> tuple[int, float, str]:
    env = dict(os.environ, PYTHONPATH=str(dest), MUTATION_ROOT=str(dest), PYTHONDONTWRITEBYTECODE="1")
    # Plain asserts: a verdict needs only the exit status, and with no bytecode written pytest
    # would rewrite its plugins' modules again in every run (a second or more of each).
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "--assert=plain", "-p", "no:randomly"]
    cmd += [
        "-p",
        "_mutation_probe",
        "--hypothesis-seed=0",
        "--hypothesis-profile=mutation",
        "-o",
        "addopts=--strict-markers -p no:cacheprovider",
        *tests,
    ]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        return -1, time.monotonic() - start, f"timed out after {RUN_TIMEOUT} s"
    return done.returncode, time.monotonic() - start, (done.stdout + done.stderr)[-3000:]


def verdict_of(rc: int) -> str:
    """What a pytest exit status says of a mutation: 1 (tests failed) means it was caught."""
    if rc == 1:
        return "caught"
    if rc == 0:
        return "SURVIVED"
    if rc == PROBE_FAILED:
        return "ERROR: copy not imported"
    return "ERROR: timeout" if rc == -1 else f"ERROR (exit {rc})"


# Caught by a race its test sets up (a thread writing to an array while it is saved), which a
# second run on the other core can keep from happening: it survived once in CI when run beside one.
RACES = {"hash one buffer, encode another"}


def alone(mutation: Mutation) -> bool:
    """Whether the mutation's tests start processes of their own and bound them by timeouts, or
    catch it by a race: they run while no other run does, so that what they see is the
    mutation's doing, not the load's."""
    return mutation.name in RACES or any(t.startswith("tests/system/") for t in mutation.tests)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("names", nargs="*", help="run only the mutations whose name contains one of these")
    parser.add_argument("--list", action="store_true", help="print the table and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the output of every run")
    parser.add_argument(
        "-j", "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs at once (default 2)"
    )
    args = parser.parse_args()
    missing = RACES - {x.name for x in MUTATIONS}
    assert not missing, f"RACES names no mutation: {missing}"
    chosen = [x for x in MUTATIONS if not args.names or any(n in x.name for n in args.names)]
    if args.list:
        for x in chosen:
            print(f"{x.name}\n    {x.file}: {x.why}\n    tests: {' '.join(x.tests)}")
        return 0
    jobs = max(1, args.jobs)
    with tempfile.TemporaryDirectory(prefix="treestore-mutations-") as tmp:
        copies: queue.Queue[Path] = queue.Queue()
        for i in range(jobs):  # one copy of the package and the tests per run at once
            dest = Path(tmp) / f"copy{i}"
            copy_tree(dest)
            copies.put(dest)

        def run_in_a_copy(
            tests: list[str], mutation: Mutation | None = None
        ) -> tuple[int | None, float, str]:
            """pytest's exit status in a free copy, with ``mutation`` applied (None: its snippet
            was not found), the seconds it took, and the end of its output."""
            dest = copies.get()
            try:
                if mutation is not None and (problem := apply(dest, mutation)) is not None:
                    return None, 0.0, problem
                try:
                    return run_tests(dest, tests)
                finally:
                    if mutation is not None:
                        restore(dest, mutation)
            finally:
                copies.put(dest)

        # The clean run: the tests of the mutations run together, split over runs at the head of
        # the queue of runs at once; those of the mutations run alone, in one run of their own
        # after every other run. The copies are the same tree, so a test that passed in one copy
        # passes in each: every test runs once, and its mutations wait for no copy but their own.
        # No verdict counts unless the whole clean run passed; once a part fails, no mutation
        # starts.
        solo = {t for x in chosen if alone(x) for t in x.tests}
        every = sorted({t for x in chosen for t in x.tests} - solo)
        together = [x for x in chosen if not alone(x)]
        failed = threading.Event()
        skipped = (None, 0.0, "not run: the clean run failed")

        def clean_part(tests: list[str]) -> tuple[int | None, float, str]:
            outcome = run_in_a_copy(tests)
            if outcome[0] != 0:
                failed.set()
            return outcome

        def mutated(x: Mutation) -> tuple[int | None, float, str]:
            return skipped if failed.is_set() else run_in_a_copy(list(x.tests), x)

        def clean_passed(parts: list[tuple[int | None, float, str]], what: str) -> bool:
            passed = all(rc == 0 for rc, _, _ in parts)
            took = time.monotonic() - start
            print(f"{what}: {'passed' if passed else 'FAILED'} in {took:.0f} s", flush=True)
            if not passed:
                print("\n".join(out for _, _, out in parts))
                print("the tests fail without any mutation (or the copy is not what they import)")
            return passed

        rows = []

        def report(x: Mutation, rc: int | None, took: float, out: str) -> None:
            verdict = "SNIPPET NOT FOUND" if rc is None else verdict_of(rc)
            rows.append((x, verdict, took))
            print(f"{verdict:>8}  {took:5.1f} s  {x.name}", flush=True)
            if args.verbose or verdict != "caught":
                print(out)

        start = time.monotonic()
        with ThreadPoolExecutor(jobs) as pool:
            parts = [pool.submit(clean_part, s) for s in (every[i::jobs] for i in range(jobs)) if s]
            runs = [pool.submit(mutated, x) for x in together]
            if not clean_passed([p.result() for p in parts], f"clean run of {len(every)} test selections"):
                pool.shutdown(cancel_futures=True)
                return 1
            for x, run in zip(together, runs, strict=True):
                report(x, *run.result())
        if solo:
            start = time.monotonic()
            if not clean_passed([run_in_a_copy(sorted(solo))], f"clean run of {len(solo)} run alone"):
                return 1
        for x in chosen:
            if alone(x):
                report(x, *run_in_a_copy(list(x.tests), x))
    failures = sum(verdict != "caught" for _, verdict, _ in rows)
    width = max(len(x.name) for x, _, _ in rows) if rows else 10
    print(f"\n{'mutation':<{width}}  {'caught?':<17}  tests")
    for x, verdict, _ in rows:
        print(f"{x.name:<{width}}  {verdict:<17}  {', '.join(t.split('::')[-1] for t in x.tests)}")
    print(f"\n{len(rows) - failures} of {len(chosen)} mutations caught")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
