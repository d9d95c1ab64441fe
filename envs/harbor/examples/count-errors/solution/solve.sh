#!/bin/bash
set -e
cd /app/logs
for f in $(ls *.log | sort); do echo "$f $(grep -c ERROR "$f" || true)"; done > /app/report.txt
