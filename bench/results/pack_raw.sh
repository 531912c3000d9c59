#!/usr/bin/env bash
# Packs one bench/results folder's raw output into <folder>/raw.tar.xz, so the tree keeps only
# what a reader needs first: the README, the command that made the folder and its summaries.
#
#   bench/results/pack_raw.sh [-n] [--no-git] FOLDER [KEEP_PATTERN ...]
#
# Kept as plain files: the KEEP_PATTERNs given plus these defaults, all matched at the
# folder's top level only: README.md README *.sh cmd* command* summary*.txt summary*.json
# *.md (tables) *.png (plots). A pattern is a shell glob on the path relative to FOLDER; one
# without a '/' matches top-level files only (`'*.json'` keeps the top-level JSON,
# `'call1/*'` everything directly in call1/). Every other file under FOLDER (logs, per-run
# JSON / JSONL, ncu reports, CSV, traces, sub-folders) goes into FOLDER/raw.tar.xz with paths
# relative to FOLDER, sorted, mtime the folder's date (else the epoch), owner 0 — the same
# input gives the same bytes with the same tar and xz.
#
# Then, unless --no-git, the packed files leave the index (git rm --cached), are deleted, and
# the archive is staged (git add). Nothing is committed. -n lists what would be packed.
#
# Read one file back:  tar -xJf FOLDER/raw.tar.xz -O path/in/archive
# List the archive:    tar -tJf FOLDER/raw.tar.xz
#
# A folder already holding raw.tar.xz is refused: result folders are not rewritten.
set -euo pipefail

dry_run=0
use_git=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n) dry_run=1; shift ;;
    --no-git) use_git=0; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    --) shift; break ;;
    -*) echo "pack_raw.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { echo "usage: pack_raw.sh [-n] [--no-git] FOLDER [KEEP_PATTERN ...]" >&2; exit 2; }
folder="${1%/}"; shift
[[ -d "$folder" ]] || { echo "pack_raw.sh: $folder is not a folder" >&2; exit 2; }
[[ ! -e "$folder/raw.tar.xz" ]] || { echo "pack_raw.sh: $folder/raw.tar.xz exists" >&2; exit 1; }

keep=(README.md README '*.sh' 'cmd*' 'command*' 'summary*.txt' 'summary*.json' '*.md' '*.png' "$@")

kept() {  # kept <relative path>
  local path="$1" pat
  for pat in "${keep[@]}"; do
    if [[ "$pat" == */* ]]; then
      # shellcheck disable=SC2053
      [[ "$path" == $pat ]] && return 0
    else
      # shellcheck disable=SC2053
      [[ "$path" != */* && "$path" == $pat ]] && return 0
    fi
  done
  return 1
}

pack=()
while IFS= read -r -d '' path; do
  path="${path#./}"
  kept "$path" || pack+=("$path")
done < <(cd "$folder" && find . -type f -print0 | LC_ALL=C sort -z)

if [[ ${#pack[@]} -eq 0 ]]; then
  echo "pack_raw.sh: nothing to pack in $folder"
  exit 0
fi
if [[ $dry_run -eq 1 ]]; then
  printf '%s\n' "${pack[@]}"
  exit 0
fi

base="$(basename "$folder")"
mtime=@0
if [[ "$base" =~ ^([0-9]{4}-[0-9]{2}-[0-9]{2}) ]]; then mtime="${BASH_REMATCH[1]} 00:00:00 UTC"; fi

printf '%s\0' "${pack[@]}" |
  (cd "$folder" && XZ_OPT='-6 -T1' LC_ALL=C tar --create --xz --file raw.tar.xz --format=gnu \
     --no-recursion --null --files-from=- --mtime="$mtime" --owner=0 --group=0 \
     --numeric-owner --mode='u=rw,go=r')

# The archive must hold exactly the listed files before anything is deleted.
diff <(printf '%s\n' "${pack[@]}") <(tar -tJf "$folder/raw.tar.xz") >/dev/null ||
  { echo "pack_raw.sh: $folder/raw.tar.xz does not match the file list" >&2; rm -f "$folder/raw.tar.xz"; exit 1; }

retry_git() {  # another session may hold .git/index.lock for a moment
  local _
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    if "$@" 2>/tmp/pack_raw.$$.err; then rm -f /tmp/pack_raw.$$.err; return 0; fi
    if grep -q 'index.lock' /tmp/pack_raw.$$.err; then sleep 3; continue; fi
    cat /tmp/pack_raw.$$.err >&2; rm -f /tmp/pack_raw.$$.err; return 1
  done
  cat /tmp/pack_raw.$$.err >&2; rm -f /tmp/pack_raw.$$.err; return 1
}

if [[ $use_git -eq 1 ]]; then
  declare -A tracked=()
  while IFS= read -r -d '' path; do tracked["${path#"$folder"/}"]=1; done \
    < <(git ls-files -z -- "$folder")
  untrack=()
  for path in "${pack[@]}"; do [[ -n "${tracked[$path]:-}" ]] && untrack+=("$folder/$path"); done
  if [[ ${#untrack[@]} -gt 0 ]]; then
    list="$(mktemp)"
    printf '%s\0' "${untrack[@]}" >"$list"
    GIT_LITERAL_PATHSPECS=1 retry_git git rm -q --cached --pathspec-from-file="$list" \
      --pathspec-file-nul
    rm -f "$list"
  fi
fi
(cd "$folder" && printf '%s\0' "${pack[@]}" | xargs -0 rm -f && find . -mindepth 1 -type d -empty -delete)
if [[ $use_git -eq 1 ]]; then retry_git git add -- "$folder/raw.tar.xz"; fi
echo "pack_raw.sh: packed ${#pack[@]} files into $folder/raw.tar.xz ($(du -k "$folder/raw.tar.xz" | cut -f1) KiB)"
