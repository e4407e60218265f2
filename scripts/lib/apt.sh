# Sourced by scripts/test.d/*.sh: need_apt CMD:PACKAGE ... installs the
# Debian packages whose commands are missing (quietly; apt-get update only
# when a first install fails). Returns non-zero when they cannot be had.
need_apt() {
  local missing=()
  for pair in "$@"; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || {
    apt-get update -qq >/dev/null
    apt-get install -y -qq "${missing[@]}" >/dev/null
  }
}
