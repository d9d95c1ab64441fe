#!/bin/bash
set -e
sed -i -e 's/^debug = true$/debug = false/' -e 's/^port = 5000$/port = 8080/' /app/settings.ini
