#!/usr/bin/env bash
# llama3_8b: run line N on node N (2 nodes). The job directory
# must be on a file system every node sees.
# node 0
CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_SOCKET_IFNAME=eth0 PYTHONUNBUFFERED=1 '/opt/my venv/bin/python' -m gridwright.launchers.agent --job-dir '/tmp/x/my jobs/ünï côde' --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500
# node 1
CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_SOCKET_IFNAME=eth0 PYTHONUNBUFFERED=1 '/opt/my venv/bin/python' -m gridwright.launchers.agent --job-dir '/tmp/x/my jobs/ünï côde' --nnodes=2 --nproc_per_node=8 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500
