#!/bin/sh
# What every MSN image shares, whatever its base image (the Dockerfile runs this once on the slim Python base and
# once on the CUDA base: a Docker stage has a single parent, so a shared stage cannot sit on both):
# a Python 3 with venv, the unprivileged user msn (UID/GID 10001, the runAsUser of deploy/k8s) and an empty
# /opt/venv that each target installs its extras into.
set -eu
if ! python3 -c "import venv, ensurepip" 2>/dev/null; then
    # Ubuntu's archive keeps only the newest build of a package, so apt versions cannot be pinned durably;
    # reproducibility comes from the pinned base image tag.
    apt-get update
    apt-get install -y --no-install-recommends python3 python3-venv ca-certificates
    rm -rf /var/lib/apt/lists/*
fi
groupadd --system --gid 10001 msn
useradd --system --uid 10001 --gid msn --home-dir /home/msn --create-home --shell /usr/sbin/nologin msn
python3 -m venv /opt/venv
