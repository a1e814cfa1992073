#!/usr/bin/env bash
# The GPU bring-up's wheels (tools/gpu/fetch_wheels.sh), at the path docs/development.md, docs/operations.md and
# .ci/run name.
exec bash "$(dirname "$0")/gpu/fetch_wheels.sh" "$@"
