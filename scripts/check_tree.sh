#!/usr/bin/env bash
# Fails when the tree tells its development history or points outside the repository: work periods,
# issue or pull-request numbers, work branches, paths outside the repository, or where a command ran
# (the patterns below).
# The project describes its design and its measurements; git history keeps how it got there.
# Prints file:line:text for every hit and exits 1, or exits 0 when the tree is clean.
# Usage: scripts/check_tree.sh [ROOT]   (default: the repository holding this script)
# Searches the tracked files with git grep, or every file under ROOT with grep outside a git checkout.
# The patterns are written with bracket expressions so that this file does not match itself.
set -euo pipefail

root=${1:-"$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"}
cd "$root"

patterns=(
  'sessio[n]s? [0-9]'                       # work periods
  'issue[s]? #?[0-9]'                       # issue numbers
  '\(#[0-9]+\)'                             # "(#12)": an issue or pull request
  '(^|[[:space:]])#[0-9]{1,5}([^0-9a-zA-Z_]|$)'  # " #12"; not #include, #pragma, #fff, ##
  'wi[p]/'                                  # work branches
  '\.\./share[d]'                           # a folder outside the repository
  'devic[e] calls?'                         # where a command ran
  'workstatio[n]'
)
args=()
for p in "${patterns[@]}"; do args+=(-e "$p"); done
self='scripts/check_tree.sh'

if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  hits=$(git grep -n -I -i -E "${args[@]}" -- . ":(exclude)$self" || true)
else
  hits=$(grep -r -n -I -i -E "${args[@]}" \
           --exclude-dir=.git --exclude-dir=build --exclude-dir=runs --exclude-dir='build-*' . |
         sed 's|^\./||' | grep -v "^$self:" || true)
fi

if [[ -n "$hits" ]]; then
  printf '%s\n' "$hits"
  echo "check_tree: $(printf '%s\n' "$hits" | wc -l) line(s) name work periods, issues, branches or paths outside the repository" >&2
  exit 1
fi
exit 0
