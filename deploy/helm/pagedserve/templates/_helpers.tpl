{{- define "pagedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pagedserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Helm's recommended labels. */}}
{{- define "pagedserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: pagedserve
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The component whose pod runs the gRPC gateway: the server pod, or the KubeRay head. */}}
{{- define "pagedserve.gatewayComponent" -}}
{{- if eq .Values.mode "kuberay" }}head{{ else }}server{{ end -}}
{{- end -}}

{{- define "pagedserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "pagedserve.device" -}}
{{- if ne .Values.engine.device "auto" }}{{ .Values.engine.device }}{{ else if .Values.gpu.enabled }}cuda{{ else }}cpu{{ end -}}
{{- end -}}

{{- define "pagedserve.terminationGracePeriodSeconds" -}}
{{- $drain := .Values.engine.drainTimeout -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds -}}
{{- add (ceil $drain | int) 30 -}}
{{- else -}}
{{- .Values.terminationGracePeriodSeconds -}}
{{- end -}}
{{- end -}}

{{/* Checks across values that values.schema.json cannot express; fails the render with the reason. */}}
{{- define "pagedserve.validate" -}}
{{- $v := .Values -}}
{{- $grace := include "pagedserve.terminationGracePeriodSeconds" . | float64 -}}
{{- if le $grace (float64 $v.engine.drainTimeout) -}}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed engine.drainTimeout (%v): Kubernetes kills the pod at the end of the grace period, cutting the drain short" $grace $v.engine.drainTimeout) -}}
{{- end -}}
{{- if and (eq $v.probes.handler "http") (not $v.server.httpApi.enabled) -}}
{{- fail "probes.handler http needs server.httpApi.enabled" -}}
{{- end -}}
{{- if and (eq $v.mode "kuberay") $v.gpu.enabled -}}
{{- $tp := int $v.engine.tensorParallelSize -}}
{{- $slots := 0 -}}
{{- range $v.kuberay.workerGroups -}}
{{- $gpus := int (default $tp .gpusPerPod) -}}
{{- if lt $gpus $tp -}}
{{- fail (printf "worker group %s has %d GPUs per pod, fewer than tensorParallelSize %d: a TP group never spans pods" .name $gpus $tp) -}}
{{- end -}}
{{- $slots = add $slots (mul (int .replicas) (div $gpus $tp)) -}}
{{- end -}}
{{- if lt (int $slots) (int $v.engine.dataParallelSize) -}}
{{- fail (printf "the worker groups hold %d TP groups of %d GPUs, fewer than dataParallelSize %d" (int $slots) $tp (int $v.engine.dataParallelSize)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
