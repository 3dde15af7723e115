#!/usr/bin/env bash
# Builds kvgate-epp-front, the endpoint picker's native ext_proc front end
# (`kvgate epp --frontend native`; native/epp/front.cc), into .venv/bin.
# Needs Debian's gRPC C++ (libgrpc++-dev, protobuf-compiler-grpc; installed when missing) and
# .venv (xds-protos: Envoy's API, whose descriptors protoc compiles to C++ here, so the C++
# messages are exactly the Python picker's). Idempotent: the generated API (about a minute
# on 2 cores) is rebuilt only when its descriptors change, front.cc only when it changes.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.venv/bin/kvgate-epp-front
BUILD=.cache/native
missing=()
command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
command -v grpc_cpp_plugin >/dev/null 2>&1 || missing+=(protobuf-compiler-grpc)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
pkg-config --exists grpc++ 2>/dev/null || missing+=(libgrpc++-dev libprotobuf-dev)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
if [ ${#missing[@]} -gt 0 ]; then
  ./scripts/apt_install.sh "${missing[@]}"
fi
mkdir -p "$BUILD"
files=$(.venv/bin/python -m gateway.epp.descriptors "$BUILD/ext_proc.desc.new")
api=$( (cat "$BUILD/ext_proc.desc.new"; protoc --version) | sha256sum | cut -c1-16)
if [ "$(cat "$BUILD/api.stamp" 2>/dev/null)" != "$api" ]; then
  rm -rf "$BUILD/gen" "$BUILD/obj" && mkdir -p "$BUILD/gen" "$BUILD/obj"
  protoc --descriptor_set_in="$BUILD/ext_proc.desc.new" --cpp_out="$BUILD/gen" \
    --grpc_out="$BUILD/gen" --plugin=protoc-gen-grpc="$(command -v grpc_cpp_plugin)" $files
fi
mkdir -p "$BUILD/obj"
flags="-O2 -std=c++17 -I$BUILD/gen $(pkg-config --cflags grpc++ protobuf)"
srcs=(native/epp/front.cc $(find "$BUILD/gen" -name '*.cc' | sort))
objs=()
todo=()
for src in "${srcs[@]}"; do
  obj="$BUILD/obj/$(echo "$src" | tr '/.' '__').o"
  objs+=("$obj")
  if [ ! -f "$obj" ] || [ "$src" -nt "$obj" ]; then todo+=("g++ $flags -c $src -o $obj"); fi
done
if [ ${#todo[@]} -eq 0 ] && [ -x "$OUT" ]; then
  exit 0
fi
if [ ${#todo[@]} -gt 0 ]; then
  printf '%s\n' "${todo[@]}" | xargs -P "$(nproc)" -I{} sh -c '{}' \
    || { echo "setup_native: compiling failed" >&2; exit 1; }
fi
g++ -O2 -o "$OUT" "${objs[@]}" $(pkg-config --libs grpc++ protobuf) -labsl_synchronization -lpthread
echo "$api" > "$BUILD/api.stamp"
echo "built $OUT"
