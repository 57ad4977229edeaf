"""Every image the compose files name, built locally with Podman on a machine that can pull none.

    python -m localimages build      # builds what changed (each image cached by a content hash)
    python -m localimages env        # the variables that point the compose files at the local images
    python -m localimages sizes      # the images and their sizes

Bases come from Debian's packages (mmdebstrap, then `podman import`); Python packages from wheels
built on the host (`pip wheel`); Kafka's jars from the host's Maven cache (localkafka/poms/). Nothing
is downloaded inside a container except Debian packages a project Dockerfile installs with apt.
See docs/deployment.md ("Local images").
"""
