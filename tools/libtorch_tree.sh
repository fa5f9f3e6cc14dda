#!/usr/bin/env bash
# Lays Debian's libtorch out as a libtorch tree (include/ and lib/, as
# pytorch.org ships it), made of symbolic links, so that DDPRPC_LIBTORCH can
# be tried on a machine with no other libtorch:
#   tools/libtorch_tree.sh /tmp/libtorch
#   ./bazelw build --repo_env=DDPRPC_LIBTORCH=/tmp/libtorch //...
set -euo pipefail
dir=${1:?usage: libtorch_tree.sh DIR}
lib=$(dirname "$(readlink -f /usr/lib/*/libtorch.so)")
mkdir -p "$dir/include" "$dir/lib"
for d in ATen c10 caffe2 torch; do
  ln -sfn "/usr/include/$d" "$dir/include/$d"
done
for l in libtorch libtorch_cpu libc10; do
  ln -sf "$lib/$l.so" "$dir/lib/$l.so"
done
echo "$dir: libtorch tree of Debian's libtorch ($lib)"
