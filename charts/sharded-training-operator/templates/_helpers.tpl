{{/* Names and labels shared by every template. */}}
{{- define "sto.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sto.fullname" -}}
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

{{- define "sto.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sto.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sto.labels" -}}
{{ include "sto.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "sto.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "sto.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Rules on the namespaced objects a job owns: the same in a ClusterRole or a per-namespace Role. */}}
{{- define "sto.namespacedRules" -}}
- apiGroups: [training.sharded.dev]
  resources: [shardedtrainingjobs]
  verbs: [get, list, watch, patch, update, delete]
- apiGroups: [training.sharded.dev]
  resources: [shardedtrainingjobs/status]
  verbs: [get, patch, update]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete]
- apiGroups: [""]
  resources: [services, configmaps, persistentvolumeclaims]
  verbs: [get, create]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create]
- apiGroups: [scheduling.volcano.sh, scheduling.x-k8s.io]
  resources: [podgroups]
  verbs: [get, create, patch]
{{- end -}}
