#!/bin/sh
# Harden the base before the agent's environment is used (shared by the Docker image and the
# E2B template):
# - an unprivileged user `agent` (10001:10001) whose HOME is /tmp (a tmpfs at run time);
# - no pip, setuptools or ensurepip for the system interpreter (nothing can install packages);
# - no package managers (apt, dpkg binaries); dpkg's status database stays so that image
#   scanners can still list the installed Debian packages;
# - no setuid/setgid binaries (su, passwd, mount, sudo, ...);
# - a byte-compiled standard library: python:*-slim ships it without .pyc files, and with a
#   read-only root every run would compile what it imports again (up-to-date .pyc files, as
#   Debian's, are left alone).
# Neither supported base ships a compiler, and none is installed: only wheels go in.
set -eux
groupadd --gid 10001 agent
useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
    --shell /usr/sbin/nologin agent
rm -rf /usr/local/bin/pip* /usr/bin/pip* \
    /usr/local/lib/python3*/site-packages/pip* \
    /usr/local/lib/python3*/site-packages/setuptools* \
    /usr/local/lib/python3*/site-packages/wheel* \
    /usr/local/lib/python3*/site-packages/_distutils_hack \
    /usr/local/lib/python3*/site-packages/distutils-precedence.pth \
    /usr/lib/python3/dist-packages/pip* /usr/lib/python3/dist-packages/setuptools* \
    /usr/local/lib/python3*/ensurepip /usr/lib/python3.*/ensurepip \
    /usr/share/python-wheels
rm -rf /usr/bin/apt* /usr/lib/apt /etc/apt /var/lib/apt /var/cache/apt /var/log/apt \
    /usr/bin/dpkg* /usr/sbin/dpkg* /usr/lib/dpkg /etc/dpkg /var/log/dpkg.log \
    /usr/bin/debconf* /usr/sbin/debconf* /usr/share/debconf
find / -xdev -type f -perm /6000 -exec chmod a-s {} +
python3 -m compileall -q -j 0 -x '/(test|tests|idle_test)/' \
    "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
rm -f /harden.sh
