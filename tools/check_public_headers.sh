#!/usr/bin/env bash
# Checks that every public header of rpc/, autograd/, optim/, ddp/ and
# models/ compiles in a translation unit of its own and pulls in no gRPC or
# protobuf header (directly or through other headers):
#   tools/check_public_headers.sh [-I DIR | -D MACRO]... [ROOT]
# Public headers: every *.h under those directories except paths containing
# /internal/, /testing/ or /fuzz/, and except rpc/wire/ and rpc/transport/
# (the wire format's and the transport's own headers). Each is run through
# g++ -std=c++17 -H, with ROOT (default: the tree holding this script) and
# the -I/-D flags given (default: .venv's libtorch) on the include path;
# forbidden are files under a grpc/, grpcpp/, grpc++/ or google/protobuf/
# directory and any *.pb.h, also one that is missing (a generated header).
# A header whose own .cc includes it first already compiles on its own in
# the build (that .cc's first lines are the header), so it is only
# preprocessed (-E), which finds every include; any other header is
# compiled (-fsyntax-only). Prints, for each failing header, the forbidden
# header and the chain of includes that reached it, or the compiler's
# errors; exits 1 if any header fails. JOBS (default 2) run at once.
set -euo pipefail

flags=()
root=""
while (($#)); do
  case "$1" in
    -I | -D) flags+=("$1$2"); shift 2 ;;
    -I* | -D*) flags+=("$1"); shift ;;
    *) root="$1"; shift ;;
  esac
done
if [[ -z "$root" ]]; then
  root=$(dirname "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")")
fi
root=$(cd "$root" && pwd -P)
if ((${#flags[@]} == 0)); then
  # ./bazelw's .venv: the libtorch of PyTorch's wheel (repositories.bzl).
  torch=$(echo "$root"/.venv/lib/python3*/site-packages/torch)
  flags=(-I"$torch/include" -I"$torch/include/torch/csrc/api/include")
fi

cd "$root"
mapfile -t headers < <(
  find rpc autograd optim ddp models -name '*.h' -type f 2>/dev/null |
    grep -v -e '/internal/' -e '/testing/' -e '/fuzz/' -e '^rpc/wire/' -e '^rpc/transport/' |
    sort
)
if ((${#headers[@]} == 0)); then
  echo "check_public_headers: no headers under $root" >&2
  exit 1
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# Compiles one header; leaves what is wrong with it in $out/<header>.fail
# (absent when nothing is).
check_one() {
  local header=$1 fail="$out/${1//\//__}.fail"
  local log="$fail.log" status=0 mode=-fsyntax-only own="${1%.h}.cc"
  if [[ -f "$own" && "$(grep -m1 -E '^[[:space:]]*#[[:space:]]*include' "$own")" == "#include \"$header\"" ]]; then
    mode=-E
  fi
  g++ -std=c++17 "$mode" -o /dev/null -H -w -x c++ -I. "${flags[@]}" "$header" >"$log" 2>&1 || status=$?
  # -H prints one line per file opened, dots giving its depth, so the lines
  # above a forbidden one give the chain that reached it; a forbidden header
  # that is not there (a generated *.pb.h) ends the compile with a fatal
  # error, after gcc's "In file included from" chain. Each place where the
  # chain first turns forbidden is reported once.
  awk -v header="$header" -v root="$root/" '
    function forbidden(path) {
      return path ~ /(^|\/)(grpc|grpcpp|grpc\+\+)\// || path ~ /(^|\/)google\/protobuf\// ||
             path ~ /\.pb\.h$/
    }
    function shorten(path) {
      if (index(path, root) == 1) path = substr(path, length(root) + 1)
      sub(/^\.\//, "", path)
      return path
    }
    function report(path, via) {
      if (path in reported) return
      reported[path] = 1
      print "  pulls in " path
      print "    via " via
    }
    /^\.+ / {
      depth = index($0, " ") - 1
      chain[depth] = shorten(substr($0, depth + 2))
      if (forbidden(chain[depth]) && (depth == 1 || !forbidden(chain[depth - 1]))) {
        via = header
        for (d = 1; d < depth; ++d) via = via " -> " chain[d]
        report(chain[depth], via)
      }
      next
    }
    /^In file included from / { nvia = 0 }
    /^In file included from |^ +from / {
      from = $0
      sub(/^(In file included)? *from /, "", from)
      sub(/:[0-9]+[:,]$/, "", from)
      via_files[++nvia] = shorten(from)
      next
    }
    /fatal error: .*: No such file or directory/ {
      missing = $0
      sub(/^.*fatal error: /, "", missing)
      sub(/: No such file or directory.*$/, "", missing)
      if (forbidden(missing)) {
        includer = $0
        sub(/:[0-9]+:[0-9]+: fatal error: .*$/, "", includer)
        includer = shorten(includer)
        via = header
        for (i = nvia; i >= 1; --i) if (via_files[i] != header) via = via " -> " via_files[i]
        if (includer != header) via = via " -> " includer
        report(missing " (not found)", via)
      }
    }
    { nvia = 0 }
  ' "$log" >"$fail"
  if ((status != 0)); then
    # Errors other than a missing forbidden header: it does not compile.
    local errors
    errors=$(grep -v -E '^\.+ ' "$log" | grep -E 'error:' |
      grep -v -E 'fatal error: ([^:]*/)?(grpc|grpcpp|grpc\+\+|google/protobuf)/[^:]*: No such file|fatal error: [^:]*\.pb\.h: No such file' |
      head -n 20 || true)
    if [[ -n "$errors" ]]; then
      echo "  does not compile on its own:" >>"$fail"
      while IFS= read -r line; do echo "    $line"; done <<<"$errors" >>"$fail"
    fi
  fi
  [[ -s "$fail" ]] || rm -f "$fail"
  rm -f "$log"
}
export -f check_one
export out root
export flags_str="${flags[*]}"

start=$SECONDS
# shellcheck disable=SC2016  # expanded by the inner bash
printf '%s\n' "${headers[@]}" |
  xargs -P "${JOBS:-2}" -I{} bash -c 'read -r -a flags <<<"$flags_str"; check_one "$1"' _ {}

failed=0
for header in "${headers[@]}"; do
  fail="$out/${header//\//__}.fail"
  if [[ -f "$fail" ]]; then
    echo "FAIL $header"
    cat "$fail"
    failed=$((failed + 1))
  fi
done
echo "check_public_headers: $failed of ${#headers[@]} public headers failed" \
  "($((SECONDS - start)) s, JOBS=${JOBS:-2})"
((failed == 0))
