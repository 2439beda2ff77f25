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

{{/* A key of server.autoscale as `serve --autoscale` reads it (the last one given wins), else its default;
   pass (dict "spec" <server.autoscale> "key" "max" "default" 4). */}}
{{- define "pagedserve.autoscaleKey" -}}
{{- $found := regexFindAll (printf "(^|,)\\s*%s\\s*=\\s*[0-9.]+" .key) .spec -1 -}}
{{- if $found }}{{ regexFind "[0-9.]+$" (last $found) }}{{ else }}{{ .default }}{{ end -}}
{{- end -}}

{{/* The model replicas the server starts with: prefill plus decode replicas when disaggregated, else
   dataParallelSize; fails on a disaggregated setting `serve` refuses. */}}
{{- define "pagedserve.replicas" -}}
{{- $e := .Values.engine -}}
{{- if gt (int $e.prefillReplicas) 0 -}}
{{- if lt (int $e.decodeReplicas) 1 -}}
{{- fail "engine.prefillReplicas needs engine.decodeReplicas >= 1" -}}
{{- end -}}
{{- if ne (int $e.dataParallelSize) 1 -}}
{{- fail "engine.prefillReplicas and engine.decodeReplicas replace engine.dataParallelSize: leave it at 1" -}}
{{- end -}}
{{- add (int $e.prefillReplicas) (int $e.decodeReplicas) -}}
{{- else if gt (int $e.decodeReplicas) 0 -}}
{{- fail "engine.decodeReplicas needs engine.prefillReplicas >= 1 (without, use engine.dataParallelSize)" -}}
{{- else -}}
{{- int $e.dataParallelSize -}}
{{- end -}}
{{- end -}}

{{/* The most model replicas the server runs: the in-server autoscaler's max where server.autoscale is set (per pool
   when disaggregated; at least the replicas it starts with), else the replicas it starts with. */}}
{{- define "pagedserve.maxReplicas" -}}
{{- $dp := int (include "pagedserve.replicas" .) -}}
{{- if .Values.server.autoscale -}}
{{- $pools := ternary 2 1 (gt (int .Values.engine.prefillReplicas) 0) -}}
{{- max $dp (mul $pools (int (include "pagedserve.autoscaleKey" (dict "spec" .Values.server.autoscale "key" "max" "default" 4)))) -}}
{{- else -}}
{{- $dp -}}
{{- end -}}
{{- end -}}

{{/* PromQL label matchers for this release's series (keda.prometheus.selector, or the labels the Prometheus
   operator gives a ServiceMonitor's targets). */}}
{{- define "pagedserve.promSelector" -}}
{{- default (printf "namespace=%q,service=%q" .Release.Namespace (include "pagedserve.fullname" .)) .Values.keda.prometheus.selector -}}
{{- end -}}

{{/* A KubeRay worker group's pod range: (dict "min" N "max" N); fixed at replicas without autoscaling. */}}
{{- define "pagedserve.workerRange" -}}
{{- $g := .group -}}
{{- if .ctx.Values.kuberay.autoscaling.enabled -}}
{{- $min := ternary 0 $g.minReplicas (kindIs "invalid" $g.minReplicas) -}}
{{- $max := ternary $g.replicas $g.maxReplicas (kindIs "invalid" $g.maxReplicas) -}}
{{- toYaml (dict "min" (int $min) "max" (int $max)) -}}
{{- else -}}
{{- toYaml (dict "min" (int $g.replicas) "max" (int $g.replicas)) -}}
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
{{- if $v.server.autoscale -}}
{{- $min := int (include "pagedserve.autoscaleKey" (dict "spec" $v.server.autoscale "key" "min" "default" 1)) -}}
{{- $max := int (include "pagedserve.autoscaleKey" (dict "spec" $v.server.autoscale "key" "max" "default" 4)) -}}
{{- if gt $min $max -}}
{{- fail (printf "server.autoscale: min (%d) exceeds max (%d; 4 unless given)" $min $max) -}}
{{- end -}}
{{- end -}}
{{- if $v.keda.enabled -}}
{{- if eq $v.mode "kuberay" -}}
{{- fail "keda.enabled is for mode singleNode: in kuberay mode the GPUs are RayCluster worker pods, which KEDA cannot place replicas on; use server.autoscale with kuberay.autoscaling.enabled" -}}
{{- end -}}
{{- if $v.server.autoscale -}}
{{- fail "keda.enabled and server.autoscale together would be two control loops on the same load (pods, and replicas inside each pod); choose one (in singleNode mode, keda: the pod is what holds the GPUs)" -}}
{{- end -}}
{{- $names := list -}}
{{- range $i, $t := $v.keda.triggers -}}
{{- $name := default (printf "trigger-%d" $i) $t.name -}}
{{- if has $name $names -}}
{{- fail (printf "keda.triggers: the name %s is used twice" $name) -}}
{{- end -}}
{{- $names = append $names $name -}}
{{- end -}}
{{- if gt (int $v.keda.minReplicaCount) (int $v.keda.maxReplicaCount) -}}
{{- fail (printf "keda.minReplicaCount (%d) exceeds keda.maxReplicaCount (%d)" (int $v.keda.minReplicaCount) (int $v.keda.maxReplicaCount)) -}}
{{- end -}}
{{- end -}}
{{- if eq $v.mode "kuberay" -}}
{{- $tp := int $v.engine.tensorParallelSize -}}
{{- $slots := 0 -}}
{{- $maxSlots := 0 -}}
{{- range $v.kuberay.workerGroups -}}
{{- $r := include "pagedserve.workerRange" (dict "ctx" $ "group" .) | fromYaml -}}
{{- if or (gt (int $r.min) (int .replicas)) (lt (int $r.max) (int .replicas)) -}}
{{- fail (printf "worker group %s: replicas (%d) must lie within minReplicas..maxReplicas (%d..%d)" .name (int .replicas) (int $r.min) (int $r.max)) -}}
{{- end -}}
{{- if $v.gpu.enabled -}}
{{- $gpus := int (default $tp .gpusPerPod) -}}
{{- if lt $gpus $tp -}}
{{- fail (printf "worker group %s has %d GPUs per pod, fewer than tensorParallelSize %d: a TP group never spans pods" .name $gpus $tp) -}}
{{- end -}}
{{- $slots = add $slots (mul (int .replicas) (div $gpus $tp)) -}}
{{- $maxSlots = add $maxSlots (mul (int $r.max) (div $gpus $tp)) -}}
{{- end -}}
{{- end -}}
{{- if $v.gpu.enabled -}}
{{- $replicas := int (include "pagedserve.replicas" .) -}}
{{- if lt (int $slots) $replicas -}}
{{- fail (printf "the worker groups hold %d TP groups of %d GPUs, fewer than the %d replicas" (int $slots) $tp $replicas) -}}
{{- end -}}
{{- $want := int (include "pagedserve.maxReplicas" .) -}}
{{- if lt (int $maxSlots) $want -}}
{{- fail (printf "server.autoscale may run %d replicas, but the worker groups hold at most %d TP groups of %d GPUs%s" $want (int $maxSlots) $tp (ternary " (at their maxReplicas)" "; raise their replicas, or enable kuberay.autoscaling with maxReplicas" $v.kuberay.autoscaling.enabled)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
