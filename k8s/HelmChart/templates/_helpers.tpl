{{/* Chart name, truncated to the 63 characters Kubernetes names allow. */}}
{{- define "primerl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "primerl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "primerl.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "primerl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component (bridge, redis, engine-vllm, ...): pass (dict "ctx" $ "component" "bridge"). */}}
{{- define "primerl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "primerl.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "primerl.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* GPU or MIG resource limits from a `gpu` values block: nvidia.com/mig-<profile> wins over a count. */}}
{{- define "primerl.gpuLimits" -}}
{{- if .migProfile }}
{{ printf "nvidia.com/mig-%s" .migProfile }}: 1
{{- else if gt (int .count) 0 }}
nvidia.com/gpu: {{ int .count }}
{{- end }}
{{- end }}

{{/* Resources block with the GPU/MIG limits merged in: pass (dict "resources" ... "gpu" ...). */}}
{{- define "primerl.resources" -}}
{{- $res := deepCopy (default dict .resources) }}
{{- $gpu := fromYaml (include "primerl.gpuLimits" .gpu) }}
{{- if $gpu }}
{{- $limits := merge (default dict (get $res "limits")) $gpu }}
{{- $_ := set $res "limits" $limits }}
{{- $requests := merge (default dict (get $res "requests")) $gpu }}
{{- $_ := set $res "requests" $requests }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{- define "primerl.secretName" -}}
{{- printf "%s-secrets" (include "primerl.fullname" .) }}
{{- end }}

{{/* Base URLs of the selected remote engine's replicas (stable StatefulSet pod names), as a JSON list. */}}
{{- define "primerl.engineUrls" -}}
{{- $type := .Values.bridge.engine.type }}
{{- $urls := list }}
{{- if ne $type "embedded" }}
{{- $pool := index .Values.engines $type }}
{{- $svc := printf "%s-%s" (include "primerl.fullname" .) $type }}
{{- range $i := until (int $pool.replicas) }}
{{- $urls = append $urls (printf "http://%s-%d.%s.%s.svc:%d" $svc $i $svc $.Release.Namespace (int $pool.port)) }}
{{- end }}
{{- end }}
{{- toJson $urls }}
{{- end }}
